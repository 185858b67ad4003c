"""Input rows -> validated, typed records; and the record of one training row.

Three row formats are recognised, per row (a file may mix them):

* ShareGPT: ``{"conversations": [{"from": "human"|"gpt"|"system", "value": str}, ...]}``
* OpenAI-style: ``{"messages": [{"role": "system"|"user"|"assistant", "content": str}, ...]}``
  (either key pair is accepted under either list key, as in speculators)
* pre-tokenised: ``{"input_ids": [int, ...], "loss_mask": [0|1, ...]}``, passed through unchanged
  apart from truncation.

Anything else raises :class:`RowRejected` with a reason code and a sentence saying what is wrong.
Tool calls, multi-part (list) content and reasoning fields are not supported: such rows are rejected
rather than silently rendered without them.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import (BAD_TOKENS, BAD_TYPE, EMPTY_ASSISTANT_MESSAGE, EMPTY_CONVERSATION, MISSING_FIELD, NO_ASSISTANT_TURN,
                     NON_STRING_CONTENT, NOT_AN_OBJECT, UNKNOWN_ROLE, RowRejected)

# ShareGPT exports name the assistant after the product it came from; all are assistant replies.
ROLE_ALIASES = {
    "system": "system",
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "bing": "assistant",
}


@dataclass(frozen=True)
class Conversation:
    """Messages normalised to ``{"role", "content"}`` with roles system/user/assistant.

    Guarantees: at least one assistant turn, every assistant turn comes after some user turn and has
    non-blank content, and the last message is an assistant turn.
    """

    messages: list[dict[str, str]]
    row_id: str | None
    leading_assistant_dropped: int = 0


@dataclass(frozen=True)
class TokenizedRow:
    """A pre-tokenised row: ids within the vocabulary, a 0/1 mask of the same length."""

    input_ids: list[int]
    loss_mask: list[int]
    row_id: str | None


@dataclass
class PreparedRow:
    """One prepared row (token ids + loss mask) as written to the parquet shards."""

    sample_id: str
    split_key: str  # the conversation-level id: all rows of one conversation land in the same split
    source: str
    input_ids: np.ndarray  # int32
    loss_mask: np.ndarray  # int8, 1 = supervised

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_supervised(self) -> int:
        return int(self.loss_mask.sum())


def row_id_of(row: Mapping[str, Any]) -> str | None:
    """The row's own id (ShareGPT ``id``), when it is a usable scalar."""
    rid = row.get("id")
    if isinstance(rid, bool) or not isinstance(rid, (str, int)):
        return None
    rid = str(rid).strip()
    return rid or None


def parse_row(row: Any, vocab_size: int) -> Conversation | TokenizedRow:
    """Validate one decoded input row; raise :class:`RowRejected` when it cannot be used."""
    if not isinstance(row, Mapping):
        raise RowRejected(NOT_AN_OBJECT, f"row is a {type(row).__name__}, not an object")
    if "input_ids" in row or "loss_mask" in row:
        return _parse_tokenized(row, vocab_size)
    for key in ("conversations", "messages"):
        if key in row:
            return _parse_conversation(row, key)
    keys = ", ".join(sorted(map(str, row.keys()))[:8]) or "none"
    raise RowRejected(MISSING_FIELD, f"no 'conversations', 'messages' or 'input_ids' field (keys: {keys})")


def _parse_tokenized(row: Mapping[str, Any], vocab_size: int) -> TokenizedRow:
    for key in ("input_ids", "loss_mask"):
        if key not in row:
            raise RowRejected(MISSING_FIELD, f"pre-tokenised row has no '{key}'")
    ids, mask = row["input_ids"], row["loss_mask"]
    # parquet hands back numpy arrays / lists; JSON hands back lists
    if isinstance(ids, np.ndarray):
        ids = ids.tolist()
    if isinstance(mask, np.ndarray):
        mask = mask.tolist()
    if not isinstance(ids, list) or not isinstance(mask, list):
        raise RowRejected(BAD_TYPE, "input_ids and loss_mask must be lists")
    if not ids:
        raise RowRejected(EMPTY_CONVERSATION, "input_ids is empty")
    if len(ids) != len(mask):
        raise RowRejected(BAD_TOKENS, f"input_ids has {len(ids)} entries but loss_mask has {len(mask)}")
    for pos, tid in enumerate(ids):
        if isinstance(tid, bool) or not isinstance(tid, int) or not 0 <= tid < vocab_size:
            raise RowRejected(BAD_TOKENS, f"input_ids[{pos}] = {tid!r} is not a token id in [0, {vocab_size})")
    clean_mask = []
    for pos, m in enumerate(mask):
        if m not in (0, 1) or isinstance(m, float):
            raise RowRejected(BAD_TOKENS, f"loss_mask[{pos}] = {m!r} is not 0 or 1")
        clean_mask.append(int(m))
    return TokenizedRow(list(ids), clean_mask, row_id_of(row))


def _message_fields(msg: Mapping[str, Any], pos: int) -> tuple[Any, Any]:
    if "role" in msg or "content" in msg:
        role_key, content_key = "role", "content"
    else:
        role_key, content_key = "from", "value"
    for key in (role_key, content_key):
        if key not in msg:
            raise RowRejected(MISSING_FIELD, f"message {pos} has no '{key}'")
    return msg[role_key], msg[content_key]


def _parse_conversation(row: Mapping[str, Any], key: str) -> Conversation:
    raw = row[key]
    if not isinstance(raw, list):
        if isinstance(raw, np.ndarray):  # parquet list column
            raw = raw.tolist()
        else:
            raise RowRejected(BAD_TYPE, f"'{key}' is a {type(raw).__name__}, not a list")
    if not raw:
        raise RowRejected(EMPTY_CONVERSATION, f"'{key}' is empty")
    messages: list[dict[str, str]] = []
    for pos, msg in enumerate(raw):
        if not isinstance(msg, Mapping):
            raise RowRejected(BAD_TYPE, f"message {pos} is a {type(msg).__name__}, not an object")
        role, content = _message_fields(msg, pos)
        canon = ROLE_ALIASES.get(role.strip().lower()) if isinstance(role, str) else None
        if canon is None:
            raise RowRejected(UNKNOWN_ROLE, f"message {pos} has role {role!r}")
        if not isinstance(content, str):
            raise RowRejected(NON_STRING_CONTENT, f"message {pos} content is a {type(content).__name__}")
        messages.append({"role": canon, "content": content})

    # ShareGPT V3 splits long chats into chunks, so many start with a reply to a prompt that is not
    # there. Such a reply cannot be learnt as a response: drop assistant turns before the first user
    # turn (system messages stay).
    first_user = next((i for i, m in enumerate(messages) if m["role"] == "user"), len(messages))
    head = [m for m in messages[:first_user] if m["role"] != "assistant"]
    dropped = first_user - len(head)
    messages = head + messages[first_user:]
    n_assistant = sum(m["role"] == "assistant" for m in messages)
    if n_assistant == 0:
        why = f"all {dropped} assistant turn(s) come before the first user turn" if dropped else "no assistant turn"
        raise RowRejected(NO_ASSISTANT_TURN, why)
    # Messages after the last reply supervise nothing: they would only lengthen the row.
    last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    messages = messages[: last + 1]
    for pos, m in enumerate(messages):
        if m["role"] == "assistant" and not m["content"].strip():
            raise RowRejected(EMPTY_ASSISTANT_MESSAGE, f"assistant message {pos} (after normalising) is blank")
    return Conversation(messages, row_id_of(row), dropped)
