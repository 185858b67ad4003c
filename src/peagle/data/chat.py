"""Render conversations with the target's own chat template and mark the supervised tokens.

The loss mask is found by rendering prefixes, which works for any template without template
markup (no ``{% generation %}`` blocks needed):

* context of the assistant turn at message *i* = tokens of
  ``render(messages[:i], add_generation_prompt=True)``;
* the turn itself = what ``render(messages[:i+1])`` adds after that context, i.e. the reply and
  the end-of-turn tokens the template emits after it (``<|im_end|>``, ``<|eot_id|>``, ...).

Texts are tokenised as wholes (``add_special_tokens=False``: templates write BOS themselves), which
is how a server tokenises the prompt. Each span is taken only after checking that the context's
tokens really are a prefix of the longer render. Two failures are possible:

* within a turn (BPE merges across the context/reply boundary, a template that changes the
  generation prompt): the conversation is rejected with ``prefix_mismatch``;
* across turns (the template rewrites history, e.g. Qwen3 drops the ``<think>`` block of earlier
  replies): one row per conversation is impossible, so the conversation becomes one row per
  assistant turn, or is rejected, depending on ``PrepareSettings.rows_per``.

Whitespace the template puts *after* the end-of-turn special token (ChatML's ``"\\n"`` after
``<|im_end|>``) is not supervised: generation stops at the special token, so the draft never has
to predict it. It stays in the row as context when more turns follow.

With a token limit, rendered texts are cut before they are tokenised (:meth:`ChatRenderer.cut_point`):
a 10 MB reply costs the tokens of the row budget, not millions of tokens that truncation throws
away. The cut never changes the tokens (or the mask) a row keeps within the limit.

Templates render in transformers' jinja sandbox (no attribute access outside it, ``range`` capped
at 100,000 items), which does not bound time: nested loops can run for ever. Each render therefore
has a wall-clock limit (``time_limit_s``, SIGALRM in the main thread, where the stages render); a
template that passes it raises :class:`~peagle.data.errors.TemplateTimeout`, which ends the stage
rather than rejecting the row: the template is the same for every row, so each further row would
only wait out the limit again.
"""
from __future__ import annotations

import hashlib
import os
import re
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import PREFIX_MISMATCH, TEMPLATE_ERROR, TOO_LONG, PrepareError, RowRejected, TemplateTimeout

TEMPLATE_TIME_LIMIT_S = 10.0  # a render takes milliseconds; only a runaway template comes near this


class _RenderTimeout(BaseException):
    """Raised inside a render by the SIGALRM handler (a BaseException: the template engine and
    transformers catch ``Exception`` and would turn it into a template error)."""


# Characters searched after the bound for a word boundary to cut at (see ChatRenderer.cut_point).
CUT_SEARCH_CHARS = 4096
_NON_SPACE = re.compile(r"\S")

# Files that define a Hugging Face tokenizer and its chat template (those present are fingerprinted).
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer.model", "vocab.json", "merges.txt", "tokenizer_config.json",
    "special_tokens_map.json", "added_tokens.json", "chat_template.jinja", "chat_template.json",
)


@dataclass
class RenderedRow:
    """Token ids and 0/1 loss mask of one row; ``turn`` is the supervised turn in per-turn rows."""

    input_ids: list[int]
    loss_mask: list[int]
    turn: int | None = None
    cut: bool = False  # the text was cut before tokenising: the row really has more tokens than these


@dataclass
class _Encoded:
    """Token ids of one rendered text; ``cut``: only the text before the cut point was tokenised."""

    ids: list[int]
    cut: bool = False
    blank_tail: bool = False  # (when cut) the text after the cut point is whitespace only


@dataclass
class Rendered:
    rows: list[RenderedRow]
    per_turn: bool  # True when the conversation was split into one row per assistant turn
    skipped_turns: int = 0  # later turns not rendered because their context alone exceeds the limit


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def tokenizer_fingerprint(path: str | os.PathLike) -> str:
    """sha256 over the tokenizer files present in ``path`` (names and contents)."""
    h = hashlib.sha256()
    found = False
    for name in TOKENIZER_FILES:
        f = Path(path) / name
        if f.is_file():
            found = True
            h.update(name.encode() + b"\0")
            h.update(f.read_bytes())
    if not found:
        raise PrepareError(f"no tokenizer files in {path} (looked for {', '.join(TOKENIZER_FILES[:3])}, ...)")
    return h.hexdigest()


class ChatRenderer:
    """Turns a :class:`~peagle.data.rows.Conversation`'s messages into loss-masked token rows."""

    def __init__(self, tokenizer: Any, template_kwargs: dict[str, Any] | None = None,
                 time_limit_s: float | None = TEMPLATE_TIME_LIMIT_S, source: str = "the target's tokenizer"):
        template = getattr(tokenizer, "chat_template", None)
        if isinstance(template, dict):  # named templates: the default one renders plain chats
            template = template.get("default")
        if not isinstance(template, str) or not template.strip():
            raise PrepareError("the target's tokenizer has no chat template; cannot render conversations")
        self.tokenizer = tokenizer
        self.template = template
        self.template_sha256 = sha256_text(template)
        self.template_kwargs = dict(template_kwargs or {})
        self.time_limit_s = time_limit_s  # per render; None: no limit
        self.source = source  # where the template comes from, for messages
        self._installed = False  # our SIGALRM handler is in place (time_limits)
        self._rendering = False
        decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        self.special_ids = {int(i) for i, tok in decoder.items() if getattr(tok, "special", False)}
        self._blank: dict[int, bool] = {}
        # The most characters one token stands for: its string in the vocabulary (byte-level BPE:
        # one character per byte, and a text character is at least one byte; SentencePiece: "▁"
        # for a space; byte-fallback "<0x0A>" and WordPiece "##" only overestimate).
        vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
        self.max_token_chars = max(map(len, vocab), default=64) or 64

    @classmethod
    def from_target(cls, path: str | os.PathLike, trust_remote_code: bool = False,
                    template_kwargs: dict[str, Any] | None = None,
                    time_limit_s: float | None = TEMPLATE_TIME_LIMIT_S) -> ChatRenderer:
        """Load the tokenizer (and its chat template) from a local target directory, offline."""
        from transformers import AutoTokenizer

        p = Path(path)
        if not p.is_dir():
            raise PrepareError(f"target {p} is not a directory (prepare it with `peagle models prepare-target`)")
        try:
            tok = AutoTokenizer.from_pretrained(str(p), trust_remote_code=trust_remote_code, local_files_only=True)
        except Exception as exc:
            raise PrepareError(f"cannot load the tokenizer of target {p}: {type(exc).__name__}: {exc}") from exc
        return cls(tok, template_kwargs, time_limit_s, f"target {p}")

    def vocab_size(self) -> int:
        return len(self.tokenizer)

    # -- rendering -------------------------------------------------------------------------------

    def _on_alarm(self, signum, frame) -> None:
        if self._rendering:
            raise _RenderTimeout

    @contextmanager
    def time_limits(self) -> Iterator[None]:
        """Keep the SIGALRM handler of the render time limit installed for the block.

        Renders outside such a block install it for themselves, at several times the cost of the
        limit's timer. No limit is set off the main thread (only it takes signals), where SIGALRM's
        handler is not Python's, or while a timer is already running (its deadline bounds the
        renders, and neither it nor its handler is ours to move).
        """
        if (self._installed or self.time_limit_s is None or not hasattr(signal, "setitimer")
                or threading.current_thread() is not threading.main_thread()
                or signal.getitimer(signal.ITIMER_REAL)[0] > 0 or signal.getsignal(signal.SIGALRM) is None):
            yield
            return
        previous = signal.signal(signal.SIGALRM, self._on_alarm)
        self._installed = True
        try:
            yield
        finally:
            self._installed = False
            signal.signal(signal.SIGALRM, previous)

    def _apply_template(self, messages: list[dict[str, str]], generation_prompt: bool) -> Any:
        with self.time_limits():  # (nothing to do inside an enclosing time_limits block)
            if not self._installed:  # no limit can be set here
                return self._call_template(messages, generation_prompt)
            self._rendering = True
            signal.setitimer(signal.ITIMER_REAL, self.time_limit_s)  # one shot: at most one _RenderTimeout
            try:
                return self._call_template(messages, generation_prompt)
            finally:
                self._rendering = False
                signal.setitimer(signal.ITIMER_REAL, 0)

    def _call_template(self, messages: list[dict[str, str]], generation_prompt: bool) -> Any:
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt, **self.template_kwargs)

    def _text(self, messages: list[dict[str, str]], generation_prompt: bool) -> str:
        try:
            text = self._apply_template(messages, generation_prompt)
        except _RenderTimeout:
            raise TemplateTimeout(
                f"the chat template of {self.source} took more than {self.time_limit_s:g} s to render one "
                "conversation (limit: prepare.template_time_limit_s); a template that loops for ever or far too "
                "long (nested range() loops, say) cannot be used: fix it, or raise the limit") from None
        except Exception as exc:  # jinja TemplateError (raise_exception in templates), TypeError, ...
            raise RowRejected(TEMPLATE_ERROR, f"{type(exc).__name__}: {str(exc)[:200]}") from None
        if not isinstance(text, str):
            raise RowRejected(TEMPLATE_ERROR, f"template rendered a {type(text).__name__}, not text")
        return text

    def prompt(self, messages: list[dict[str, str]]) -> str:
        """The text a chat server renders for ``messages`` (generation prompt added), within the time limit:
        :class:`TemplateTimeout` past it, :class:`RowRejected` when the template refuses the conversation."""
        return self._text(messages, True)

    def _is_blank(self, tid: int) -> bool:
        if tid not in self._blank:
            text = self.tokenizer.decode([tid], skip_special_tokens=False, clean_up_tokenization_spaces=False)
            self._blank[tid] = tid not in self.special_ids and text.strip() == ""
        return self._blank[tid]

    def _span_end(self, ids: list[int], start: int, end: int) -> int:
        """End of the supervised span: cut whitespace-only tokens after the last special token."""
        last_special = next((j for j in range(end - 1, start - 1, -1) if ids[j] in self.special_ids), None)
        if last_special is not None and all(self._is_blank(t) for t in ids[last_special + 1:end]):
            return last_special + 1
        return end

    def _encode(self, texts: list[str]) -> list[list[int]]:
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is not None and hasattr(backend, "encode_batch_fast"):
            # the Rust tokenizer directly, without offsets: same ids, several times faster
            return [e.ids for e in backend.encode_batch_fast(texts, add_special_tokens=False)]
        return self.tokenizer(texts, add_special_tokens=False)["input_ids"]

    def cut_point(self, text: str, max_tokens: int) -> int | None:
        """Where to cut ``text`` before tokenising it when only its first ``max_tokens`` tokens matter.

        ``None`` (tokenise it all) when the text has at most ``B = max_tokens * max_token_chars``
        characters: no token stands for more than ``max_token_chars`` characters, so a text of
        ``max_tokens`` tokens or fewer -- every row that fits -- is never cut. Longer texts are cut
        at the first space at or after ``B`` that follows a non-space character. That is a boundary
        of the pre-tokeniser's words in every family in use (the GPT-2 / Llama-3 / Qwen regexes never
        continue a word into a following space; SentencePiece starts a word at "▁"), and BPE merges
        only within words, so the tokens of ``text[:cut]`` are exactly the whole text's tokens up to
        ``cut``. They cover at least ``B`` characters, hence more than ``max_tokens`` tokens
        (:meth:`_encode_cut` checks that), and the first ``max_tokens`` of them are the whole text's.
        A text with no such space within :data:`CUT_SEARCH_CHARS` after ``B`` (one enormous "word")
        is cut at that distance: BPE merges may then differ near the cut, thousands of characters
        past the kept tokens.
        """
        bound = max_tokens * self.max_token_chars
        if len(text) <= bound:
            return None
        pos = bound
        while True:
            pos = text.find(" ", pos, bound + CUT_SEARCH_CHARS)
            if pos < 0:
                end = bound + CUT_SEARCH_CHARS
                return end if len(text) > end else None
            if not text[pos - 1].isspace():
                return pos
            pos += 1

    def _encode_cut(self, texts: list[str], max_tokens: int | None) -> list[_Encoded]:
        """:meth:`_encode`, tokenising each text only up to its :meth:`cut_point` for ``max_tokens``."""
        if max_tokens is None:
            return [_Encoded(ids) for ids in self._encode(texts)]
        cuts = [self.cut_point(t, max_tokens) for t in texts]
        encoded = self._encode([t if c is None else t[:c] for t, c in zip(texts, cuts)])
        out = []
        for text, cut, ids in zip(texts, cuts, encoded):
            scale = 4
            # A cut text must come out longer than the limit (so the row counts as truncated, and its
            # first max_tokens tokens are the whole text's). A normaliser that drops characters can
            # break that: then tokenise more of the text until it holds (or the text is whole).
            while cut is not None and len(ids) <= max_tokens:
                cut = self.cut_point(text, max_tokens * scale)
                ids = self._encode([text if cut is None else text[:cut]])[0]
                scale *= 4
            out.append(_Encoded(ids) if cut is None else
                       _Encoded(ids, True, _NON_SPACE.search(text, cut) is None))
        return out

    def render(self, messages: list[dict[str, str]], rows_per: str = "auto",
               max_tokens: int | None = None) -> Rendered:
        """Rows for one conversation (see the module docstring); raises RowRejected when unusable.

        ``messages`` must satisfy :class:`~peagle.data.rows.Conversation`'s guarantees (the last
        message is an assistant turn, each assistant turn follows a user turn). With ``max_tokens``,
        turns whose context already has that many tokens are not rendered (none of their tokens
        could be kept after truncation); rows may still be longer than ``max_tokens``: the caller
        truncates or rejects them.
        """
        turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        spans: list[tuple[int, int]] = []  # supervised [start, end) of each turn, in the render ending with it
        renders: list[_Encoded] = []  # render(messages[:i+1]) of each turn
        overflow: _Encoded | None = None  # context of the first turn that starts beyond max_tokens
        # Renders are cut before tokenising (cut_point): a cut render's tokens are the whole render's up
        # to the cut, more than max_tokens of them, so the checks below (context length against
        # max_tokens, the context as a token prefix, earlier renders as prefixes of the conversation's)
        # decide as on whole renders; texts sharing a prefix past the bound are cut at the same place.
        for k, i in enumerate(turns):
            ctx, upto = self._encode_cut([self._text(messages[:i], True), self._text(messages[: i + 1], False)],
                                         max_tokens)
            if max_tokens is not None and len(ctx.ids) >= max_tokens:
                overflow = ctx
                break
            if len(upto.ids) <= len(ctx.ids) or upto.ids[: len(ctx.ids)] != ctx.ids:
                raise RowRejected(
                    PREFIX_MISMATCH,
                    f"assistant turn {k}: the render with the generation prompt is not a token prefix of the "
                    "render including the reply",
                )
            if upto.cut and not upto.blank_tail:
                end = len(upto.ids)  # the turn (and its end-of-turn token) goes on past the kept tokens
            else:
                end = self._span_end(upto.ids, len(ctx.ids), len(upto.ids))
            spans.append((len(ctx.ids), end))
            renders.append(upto)
        if not spans:
            n = len(overflow.ids) if overflow is not None else 0
            at_least = "at least " if overflow is not None and overflow.cut else ""
            raise RowRejected(TOO_LONG, f"the context before the first reply has {at_least}{n} tokens, "
                                          f"not below the limit {max_tokens}")
        skipped = len(turns) - len(spans)

        # The conversation's render: up to its last reply, or (cut short) the context that overflowed.
        full = overflow if overflow is not None else renders[-1]
        nested = all(full.ids[: len(r.ids)] == r.ids for r in renders)
        if rows_per == "conversation" and not nested:
            raise RowRejected(
                PREFIX_MISMATCH,
                "the template renders earlier turns differently once later turns follow (renders of growing "
                "prefixes do not nest); use rows_per=assistant_turn or auto",
            )
        if nested and rows_per != "assistant_turn":
            end = len(full.ids) if overflow is not None else spans[-1][1]
            mask = [0] * end
            for start, stop in spans:
                mask[start:stop] = [1] * (stop - start)
            return Rendered([RenderedRow(list(full.ids[:end]), mask, cut=full.cut)], per_turn=False,
                            skipped_turns=skipped)
        rows = [RenderedRow(list(r.ids[:stop]), [0] * start + [1] * (stop - start), turn=k, cut=r.cut)
                for k, (r, (start, stop)) in enumerate(zip(renders, spans))]
        return Rendered(rows, per_turn=True, skipped_turns=skipped)
