"""The one parser of an OpenAI-style answer as vLLM's API server sends it, streamed or not.

A streamed answer is server-sent events: lines ``data: <JSON chunk>`` (blank lines between them), ended by
``data: [DONE]``. :func:`stream_chunks` yields each chunk's JSON object; :class:`StreamedAnswer` adds the
chunks up: choice 0's text (``delta.content`` of a chat stream, ``text`` of a completions one), its finish
reason, the ``usage`` and ``metrics.speculative_decoding`` of the chunk that carries them (vLLM puts both on
the last chunk when usage is asked for, or forced with ``--enable-force-include-usage``), and the status of
an error vLLM reports mid-stream as a chunk ``{"error": {...}}``. The helpers below read the same fields of
a JSON (not streamed) answer.

:data:`SPEC_DECODE_KEYS` are the fields of ``metrics.speculative_decoding`` (vLLM with
``--per-request-spec-decode-metrics``) that a traffic record keeps.

Both sides use it: the client that reads a stream (:mod:`peagle.engine.client`) and the capture middleware
that copied one (:mod:`peagle.traffic.middleware`). The middleware runs inside vLLM's API server, so this
module imports the standard library only.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Mapping

SPEC_DECODE_KEYS = ("acceptance_histogram", "num_spec_tokens", "num_draft_tokens", "mean_acceptance_length")
DONE = b"[DONE]"
_SHOWN = 200  # bytes of a chunk that is not JSON shown in the error


class AnswerError(ValueError):
    """An answer not of the OpenAI shape: a streamed chunk that is not a JSON object."""


class UnsupportedContent(AnswerError):
    """Message content that is neither a text nor a list of content parts."""


def data_payloads(lines: Iterable[bytes]) -> Iterator[bytes]:
    """The payload of each ``data:`` line, up to ``[DONE]``; other lines and empty payloads are passed over."""
    for raw in lines:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        payload = line[5:].strip()
        if payload == DONE:
            return
        if payload:
            yield payload


def stream_chunks(lines: Iterable[bytes]) -> Iterator[dict[str, Any]]:
    """The JSON object of each ``data:`` line (:func:`data_payloads`), in order; :class:`AnswerError` for one
    that is not. ``lines``: a response read line by line, or ``body.splitlines()`` of a copied one (bytes:
    a text's own line separators, U+2028 and the like, stay inside its JSON string)."""
    for payload in data_payloads(lines):
        try:
            chunk = json.loads(payload.decode("utf-8", "replace"))
        except ValueError as exc:
            raise AnswerError(f"invalid JSON in the stream: {exc}: {payload[:_SHOWN]!r}") from None
        if not isinstance(chunk, dict):
            raise AnswerError(f"a chunk of the stream is not a JSON object: {payload[:_SHOWN]!r}")
        yield chunk


def content_text(content: Any) -> str:
    """A message's text: a string, or the text parts of an OpenAI content list (other parts left out);
    None is no text. :class:`UnsupportedContent` for anything else."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    raise UnsupportedContent(f"message content of type {type(content).__name__}")


def choice_text(choice: Mapping[str, Any], *, chat: bool, key: str) -> str:
    """The text of one choice: ``choice[key].content`` of a chat answer (``key`` ``message``, or ``delta`` in a
    stream), ``choice.text`` of a completions one."""
    if not chat:
        return choice.get("text") or ""
    return content_text((choice.get(key) or {}).get("content"))


def first_choice(answer: Mapping[str, Any]) -> dict[str, Any]:
    """Choice 0 of a JSON answer (``index`` 0; a choice without one counts as 0), or ``{}``."""
    return next((c for c in answer.get("choices") or () if c.get("index", 0) == 0), {})


def token_counts(usage: Any) -> dict[str, int] | None:
    """``{"prompt_tokens", "completion_tokens"}`` of a ``usage`` object (a missing count is 0), or None."""
    if not isinstance(usage, dict):
        return None
    return {"prompt_tokens": int(usage.get("prompt_tokens") or 0),
            "completion_tokens": int(usage.get("completion_tokens") or 0)}


def speculative_decoding(answer: Mapping[str, Any]) -> dict[str, Any] | None:
    """``metrics.speculative_decoding`` of a JSON answer or a chunk, or None where it has none."""
    metrics = answer.get("metrics")
    spec = metrics.get("speculative_decoding") if isinstance(metrics, dict) else None
    return spec if isinstance(spec, dict) else None


def spec_decode_fields(spec: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The :data:`SPEC_DECODE_KEYS` of a ``speculative_decoding`` object (KeyError names a missing one), or
    None for None."""
    return None if spec is None else {k: spec[k] for k in SPEC_DECODE_KEYS}


@dataclass
class StreamedAnswer:
    """What the chunks of one streamed answer add up to (see the module docstring); feed them to :meth:`add`.
    ``usage`` and ``speculative_decoding`` are the objects as vLLM sent them."""

    chat: bool = True  # a chat stream (text in ``delta.content``), else a completions one (``text``)
    parts: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    speculative_decoding: dict[str, Any] | None = None
    error_status: int | None = None  # the code of an error reported in the stream (500 when it has none)

    @classmethod
    def read(cls, lines: Iterable[bytes], *, chat: bool = True) -> "StreamedAnswer":
        """The answer of a whole stream (:func:`stream_chunks` of ``lines``)."""
        answer = cls(chat=chat)
        for chunk in stream_chunks(lines):
            answer.add(chunk)
        return answer

    @property
    def text(self) -> str:
        """Choice 0's text so far."""
        return "".join(self.parts)

    def add(self, chunk: Mapping[str, Any]) -> bool:
        """Take one chunk in; True when it carried output of choice 0 (text, or token ids)."""
        if "error" in chunk:
            error = chunk["error"]
            code = error.get("code") if isinstance(error, dict) else None
            self.error_status = code if isinstance(code, int) and not isinstance(code, bool) else 500
            return False
        output = False
        for choice in chunk.get("choices") or ():
            if choice.get("index", 0) == 0:
                text = choice_text(choice, chat=self.chat, key="delta")
                self.parts.append(text)
                output = output or bool(text) or bool(choice.get("token_ids"))
                self.finish_reason = choice.get("finish_reason") or self.finish_reason
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        self.speculative_decoding = speculative_decoding(chunk) or self.speculative_decoding
        return output
