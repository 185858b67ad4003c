"""The evaluation hold-out of the embedded ShareGPT source: conversations no stage ever trains on.

A conversation of the embedded ``sharegpt`` source (:mod:`.sources`) is *held out* when
``sha256(HELDOUT_SALT, key)`` falls below :data:`HELDOUT_FRACTION`, ``key`` being the conversation
part of the row's ShareGPT ``id`` (``row<index>`` for a row without one). ShareGPT V3 cuts long
conversations into chunks ``<conversation>_<n>``; the key drops ``_<n>``, so every chunk of one
conversation is held out together (a later chunk continues the same topic). The rule depends on nothing but the key:
not on the seed, the order, ``max_samples`` or any setting, so it is the same in every run.

Guarantee by construction: the ``sharegpt`` source never yields a held-out row to its readers
(``prepare``, ``regenerate``, the data mix), and the evaluation's ``sharegpt-heldout`` prompt set
(:mod:`peagle.evaluate.prompts`) reads *only* held-out rows. So no evaluation prompt of that set is
ever a training conversation, whatever the data settings.

About 1 in 32 conversations (some 550 of the wheel's 17,671) are held out: enough for a stable
figure, few enough that training loses little.
"""
from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

HELDOUT_SALT = "peagle-heldout/v1"
HELDOUT_FRACTION = 1 / 32


def heldout_key(row: Any, index: int) -> str:
    """The key the hold-out hashes: the conversation of the row's ShareGPT ``id`` (chunk suffix
    ``_<n>`` dropped), else the row's position in the file."""
    rid = row.get("id") if isinstance(row, Mapping) else None
    if isinstance(rid, (str, int)) and not isinstance(rid, bool) and str(rid).strip():
        rid = str(rid).strip()
        conversation, _, chunk = rid.rpartition("_")
        return conversation if conversation and chunk.isdigit() else rid
    return f"row{index}"


def is_held_out(key: str) -> bool:
    """True when the conversation with this key belongs to the evaluation hold-out."""
    digest = hashlib.sha256(f"{HELDOUT_SALT}\0{key}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < HELDOUT_FRACTION
