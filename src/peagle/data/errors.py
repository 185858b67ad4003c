"""Errors of the data-preparation stage.

Two kinds, kept apart on purpose:

* :class:`RowRejected` is *expected*: one input row cannot be used. The stage catches it, counts the
  row under its reason and carries on. It never escapes :func:`peagle.data.run_prepare`.
* :class:`PrepareError` ends the stage: a source cannot be read, nothing usable is left, or too many
  rows were rejected. Its message names the file (or dataset id) and the reason.
"""
from __future__ import annotations

from typing import Any

from ..errors import PeagleError

# Rejection reasons: short, stable codes (the manifest counts rows by these). The detail string that
# goes with each rejection says which field / message / turn was at fault.
INVALID_JSON = "invalid_json"                      # a JSONL line that does not parse
INVALID_UTF8 = "invalid_utf8"                      # bytes that are not UTF-8 in the row (invalid_utf8=reject)
NOT_AN_OBJECT = "not_an_object"                    # the row is not a JSON object / mapping
MISSING_FIELD = "missing_field"                    # no conversations/messages/input_ids; a message lacks role/content
BAD_TYPE = "bad_type"                              # a field has the wrong type (e.g. conversations is not a list)
UNKNOWN_ROLE = "unknown_role"                      # a role outside system/user/assistant (and their ShareGPT aliases)
NON_STRING_CONTENT = "non_string_content"          # message content is not a string
EMPTY_CONVERSATION = "empty_conversation"          # no messages at all
NO_ASSISTANT_TURN = "no_assistant_turn"            # nothing to supervise
EMPTY_ASSISTANT_MESSAGE = "empty_assistant_message"  # an assistant reply that is empty or whitespace only
TEMPLATE_ERROR = "template_error"                  # the target's chat template raised
PREFIX_MISMATCH = "prefix_mismatch"                # renders of growing prefixes do not nest token-wise
TOO_LONG = "too_long"                              # over max_length (reject policy) or no supervised token fits
TOO_FEW_SUPERVISED = "too_few_supervised_tokens"   # fewer supervised tokens than min_supervised_tokens
BAD_TOKENS = "bad_tokens"                          # pre-tokenised row: ids out of range, mask not 0/1, lengths differ


class PrepareError(PeagleError, RuntimeError):
    """The data-preparation stage failed; the message names the source and the reason.

    ``report`` holds the counts gathered so far (same shape as the manifest's ``counts`` and
    ``rejected_by_reason``) when the failure comes after reading, else ``None``.
    """

    def __init__(self, message: str, report: dict[str, Any] | None = None):
        super().__init__(message)
        self.report = report


class TemplateTimeout(PrepareError):
    """The target's chat template ran past its time limit; it would on every row, so the stage ends."""


class RowRejected(Exception):
    """One row cannot be used. ``reason`` is one of the codes above, ``detail`` a human sentence."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail
