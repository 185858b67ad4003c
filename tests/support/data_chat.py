"""Chat templates and tokenizer copies shared by the chat-rendering tests (tests/unit/data/test_data_chat.py,
test_data_long_text.py)."""
from __future__ import annotations

from pathlib import Path

# The official Llama-3 instruct template, minus the tool/date parts.
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}"
    "{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim"
    " + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]

# Qwen3-like: a <think> block only on replies after the last user turn, so a render of the first
# turns is no longer a prefix once another user turn follows (history is rewritten).
QWEN3_LIKE_TEMPLATE = (
    "{% set ns = namespace(last_user=-1) %}"
    "{% for m in messages %}{% if m['role'] == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' and loop.index0 > ns.last_user %}"
    "{{ '<|im_start|>assistant\n<think>\n\n</think>\n\n' + m['content'] + '<|im_end|>\n' }}"
    "{% else %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def tokenizer_copy(src: Path, out: Path, template: str, specials: list[str] = (), bos: str | None = None) -> Path:
    """A copy of the tokenizer at ``src`` saved at ``out`` with ``template`` as its chat template (and ``specials``
    added as special tokens, ``bos`` as its BOS token)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(src))
    if specials:
        tok.add_tokens(list(specials), special_tokens=True)
    if bos:
        tok.bos_token = bos
    tok.chat_template = template
    tok.save_pretrained(str(out))
    return out
