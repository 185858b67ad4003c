"""The one parser of OpenAI-style answers (peagle.net.sse): a stream's ``data:`` lines, what its chunks add up
to (choice 0's text, finish reason, usage and spec-decode metrics of the chunk carrying them, an error reported
in the stream), the fields read from a JSON answer, and that importing it stays light (it runs inside vLLM's
API server)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from peagle.net.sse import (SPEC_DECODE_KEYS, AnswerError, StreamedAnswer, UnsupportedContent, choice_text,
                            content_text, data_payloads, first_choice, spec_decode_fields, speculative_decoding,
                            stream_chunks, token_counts)

SPEC = {"acceptance_histogram": [3, 2, 1], "num_spec_tokens": 2, "num_draft_tokens": 6,
        "mean_acceptance_length": 1.67, "draft_acceptance_rate": 0.5}
USAGE = {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7}


def stream(*chunks: dict, ascii_only: bool = True) -> bytes:
    events = [f"data: {json.dumps(c, ensure_ascii=ascii_only)}\n\n" for c in chunks]
    return "".join(events + ["data: [DONE]\n\n"]).encode()


def delta(text: str, index: int = 0, finish: str | None = None) -> dict:
    return {"choices": [{"index": index, "delta": {"content": text}, "finish_reason": finish}]}


def test_data_payloads_pass_over_other_lines_and_stop_at_done():
    lines = [b": a comment", b"", b"event: x", b"data: {\"a\": 1}", b"data:", b"  data:[2]  ", b"data: [DONE]",
             b"data: {\"after\": 1}"]
    assert list(data_payloads(lines)) == [b"{\"a\": 1}", b"[2]"]


def test_a_chunk_that_is_not_a_json_object_is_an_answer_error():
    with pytest.raises(AnswerError, match=r"^invalid JSON in the stream: .*: b'\{nope'$"):
        list(stream_chunks([b"data: {\"a\": 1}", b"data: {nope"]))
    with pytest.raises(AnswerError, match="not a JSON object"):
        list(stream_chunks([b"data: [1, 2]"]))
    assert isinstance(AnswerError("x"), ValueError)


def test_a_chat_stream_adds_up_to_choice_0_with_usage_and_spec_from_the_last_chunk():
    body = stream({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
                  delta("Hi"), delta("other choice", index=1), delta(" there", finish=None),
                  {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]},
                  {"choices": [], "usage": USAGE, "metrics": {"time_to_first_token_ms": 3.0,
                                                              "speculative_decoding": SPEC}})
    answer = StreamedAnswer.read(body.splitlines())
    assert (answer.text, answer.finish_reason, answer.error_status) == ("Hi there", "length", None)
    assert answer.usage == USAGE and token_counts(answer.usage) == {"prompt_tokens": 4, "completion_tokens": 3}
    assert spec_decode_fields(answer.speculative_decoding) == {k: SPEC[k] for k in SPEC_DECODE_KEYS}


def test_add_says_which_chunks_carried_output_of_choice_0():
    answer = StreamedAnswer()
    assert answer.add(delta("a")) is True
    assert answer.add(delta("")) is False and answer.add(delta("b", index=1)) is False
    assert answer.add({"choices": [{"index": 0, "delta": {"content": ""}, "token_ids": [7]}]}) is True
    assert answer.add({"choices": [], "usage": USAGE}) is False and answer.text == "a"


def test_a_completions_stream_joins_the_text_fields():
    body = stream({"choices": [{"index": 0, "text": " 4"}]}, {"choices": [{"index": 0, "text": "!",
                                                                            "finish_reason": "stop"}]})
    answer = StreamedAnswer.read(body.splitlines(), chat=False)
    assert (answer.text, answer.finish_reason, answer.usage, answer.speculative_decoding) == (" 4!", "stop", None, None)


@pytest.mark.parametrize("error, status", [({"message": "bad", "code": 400}, 400), ({"message": "boom"}, 500),
                                           ({"code": True}, 500), ("a text", 500), (None, 500)])
def test_an_error_reported_in_the_stream_gives_its_status(error, status):
    answer = StreamedAnswer.read(stream(delta("partial"), {"error": error}).splitlines())
    assert (answer.error_status, answer.text) == (status, "partial")


def test_line_separators_inside_a_text_stay_in_it():
    # vLLM writes non-ASCII text as it is: U+2028, U+0085 and the like are not line ends of the stream
    text = "a\u2028b\u0085c\u2029d\x1ce"
    answer = StreamedAnswer.read(stream(delta(text), ascii_only=False).splitlines())
    assert answer.text == text


def test_content_text_of_strings_parts_and_nothing():
    assert content_text("x") == "x" and content_text(None) == ""
    assert content_text([{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {}}, "odd",
                         {"type": "text", "text": "b"}]) == "ab"
    with pytest.raises(UnsupportedContent, match="message content of type int"):
        content_text(3)
    with pytest.raises(UnsupportedContent):
        StreamedAnswer().add({"choices": [{"delta": {"content": {"x": 1}}}]})


def test_the_fields_of_a_json_answer():
    answer = {"choices": [{"index": 1, "message": {"content": "no"}},
                          {"index": 0, "message": {"content": "yes"}, "finish_reason": "stop"}],
              "usage": {"completion_tokens": 2}, "metrics": {"speculative_decoding": SPEC}}
    choice = first_choice(answer)
    assert choice_text(choice, chat=True, key="message") == "yes" and choice["finish_reason"] == "stop"
    assert choice_text({"text": "t"}, chat=False, key="message") == "t" and first_choice({"choices": None}) == {}
    assert token_counts(answer["usage"]) == {"prompt_tokens": 0, "completion_tokens": 2}
    assert token_counts(None) is None and speculative_decoding(answer) == SPEC
    assert speculative_decoding({"metrics": [1]}) is None and speculative_decoding({}) is None
    assert spec_decode_fields(None) is None
    with pytest.raises(KeyError, match="num_spec_tokens"):
        spec_decode_fields({"acceptance_histogram": [1]})


def test_the_net_package_imports_no_heavy_library():
    code = ("import sys, peagle.net.sse, peagle.net.json_client; "
            "heavy = [m for m in ('torch', 'transformers', 'vllm', 'pydantic', 'numpy', 'yaml') if m in sys.modules]; "
            "assert not heavy, heavy")
    subprocess.run([sys.executable, "-c", code], check=True)
