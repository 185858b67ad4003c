"""Which captured records a refresh trains on, and which it keeps for the gate.

:func:`select_traffic` turns a window of :class:`~peagle.records.traffic.TrafficRecord` into a
:class:`Selection`, in this order (every record dropped is counted under one key of ``counts``):

0. ``future``: received at or after the selection's ``now`` (a writer whose clock runs ahead, or a
   foreign writer): not yet in any window, left for a later refresh. Such a record must not become the
   window's end, or every later trigger would count no new record;
1. ``failed``: status other than 200, or an empty response;
2. ``other_target``: served by a target whose fingerprint differs from the serving target's;
   ``unknown_target``: no target fingerprint recorded, so it cannot be told which target served it;
3. ``completions_endpoint``: ``/v1/completions`` requests. Their response continues the raw prompt
   text; rendered through the chat template it would be another context than the one served, so
   it is neither on-policy training data nor the workload the gate would replay;
4. ``not_user_last``: the request's last message is not a user turn (no prompt the gate can send);
5. ``duplicates`` (``refresh.dedupe``): the same conversation with the same response as an earlier record;
6. ``beyond_max_records``: older than the newest ``refresh.max_records``.

After the split (below), ``template_capped``: training records beyond the newest
``refresh.max_per_template`` of their prompt template (:func:`template_key`), when set.

What is left (``usable``) is sorted by ``received_at`` (then id). The held-out slice is the newest
records holding ``heldout_fraction`` of its distinct prompts, and at least ``min_heldout`` of them: the
gate's traffic prompts, never trained on. It is sized by distinct prompts, not records, so that one
client repeating one prompt many times cannot fill it (and then take every training record with it).
Records sharing the boundary timestamp join the held-out slice, so every training record is strictly
older than every held-out one. The held-out slice keeps one record per prompt
(``heldout_duplicate_prompts``), and training records whose prompt also is a held-out prompt are
removed from training (``train_heldout_prompts``).

Sampled responses (temperature > 0) are not the target's greedy output. ``refresh.sampled_responses``
says what the training part does with them: ``keep`` (train on them), ``drop`` (counted as
``sampled_dropped``) or ``regenerate`` (:attr:`Selection.regenerate`: the refresh lets the target
answer them again, greedily, with the regenerate stage). The held-out slice keeps them: the gate
only sends their prompts, greedily.

:func:`write_selection` writes ``train.jsonl`` (``{"id", "messages"}`` with the served response as
the last, assistant turn: a source ``peagle prepare`` takes), ``regenerate.jsonl`` (the same rows for
the records to regenerate, if any), ``heldout.jsonl`` (a prompt file of
:mod:`peagle.evaluate.prompts`: ``{"id", "messages", "category": "traffic"}``) and ``counts.json``.
"""
from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from ..errors import PeagleError
from ..records.traffic import CHAT_ENDPOINT, TrafficRecord
from ..traffic.settings import RefreshSettings

TRAIN_FILE = "train.jsonl"
REGENERATE_FILE = "regenerate.jsonl"
HELDOUT_FILE = "heldout.jsonl"
COUNTS_FILE = "counts.json"
HELDOUT_CATEGORY = "traffic"
# Every key of Selection.counts, in the order the cleaning applies them (printed in this order).
COUNT_KEYS = ("read", "future", "failed", "other_target", "unknown_target", "completions_endpoint", "not_user_last",
              "duplicates", "beyond_max_records", "usable", "heldout", "heldout_duplicate_prompts",
              "train_heldout_prompts", "template_capped", "sampled", "sampled_dropped", "sampled_regenerate",
              "train")


class TrafficSelectionError(PeagleError, ValueError):
    """The window holds too little usable traffic for a refresh; the message names the counts."""


def describe_counts(counts: dict[str, int]) -> str:
    """``read=40, failed=2, ...``: the non-zero counts (``read`` always), in cleaning order."""
    return ", ".join(f"{k}={counts[k]}" for k in COUNT_KEYS if k in counts and (counts[k] or k == "read"))


def _prompt_key(chat: list[dict[str, str]]) -> str:
    return json.dumps(chat, ensure_ascii=False, sort_keys=True, separators=(",", ":"))


def _conversation_key(record: TrafficRecord) -> str:
    return _prompt_key(record.chat()) + "\0" + record.response_text


@dataclass
class Selection:
    """A cleaned, time-split traffic window (see the module docstring).

    ``train`` holds every training record, oldest first, ``regenerate`` included (those of them whose
    responses the target rewrites); ``heldout`` the held-out slice, oldest first.
    """

    train: list[TrafficRecord]
    heldout: list[TrafficRecord]
    regenerate: list[TrafficRecord] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)
    sampled_responses: str = "keep"

    def window(self) -> dict[str, Any]:
        """``received_at`` of the first and last record of each part (None for an empty part): the
        traffic the refresh actually covered."""
        def span(records: list[TrafficRecord]) -> dict[str, str | None]:
            return {"first_received_at": records[0].received_at if records else None,
                    "last_received_at": records[-1].received_at if records else None}

        return {"train": span(self.train), "heldout": span(self.heldout)}

    def summary(self) -> dict[str, Any]:
        """What ``counts.json`` holds: the counts, the policy for sampled responses and the window."""
        return {"counts": dict(self.counts), "sampled_responses": self.sampled_responses, "window": self.window()}


def _clean(records: Iterable[TrafficRecord], target_fingerprint: str, dedupe: bool,
           counts: dict[str, int], now: datetime | None = None) -> list[TrafficRecord]:
    """Steps 0-5 of the module docstring (0 only given ``now``); the kept records sorted by time (then id)."""
    kept = []
    for r in records:
        counts["read"] += 1
        if now is not None and r.received_at_dt >= now:
            counts["future"] += 1
        elif r.status != 200 or not r.response_text.strip():
            counts["failed"] += 1
        elif r.target_fingerprint is None:
            counts["unknown_target"] += 1
        elif r.target_fingerprint != target_fingerprint:
            counts["other_target"] += 1
        elif r.endpoint != CHAT_ENDPOINT:
            counts["completions_endpoint"] += 1
        elif not r.messages or r.messages[-1]["role"] != "user":
            counts["not_user_last"] += 1
        else:
            kept.append(r)
    kept.sort(key=lambda r: (r.received_at_dt, r.id))
    if not dedupe:
        return kept
    seen: set[str] = set()
    unique = []
    for r in kept:  # oldest first: a repeat is dropped, the first occurrence kept
        key = _conversation_key(r)
        if key in seen:
            counts["duplicates"] += 1
            continue
        seen.add(key)
        unique.append(r)
    return unique


def template_key(chat: list[dict[str, str]]) -> str:
    """A prompt's template: the first non-empty line of the last user message, lower-cased, digits masked,
    whitespace collapsed -- the instruction a client wraps around its varying input."""
    text = next((m["content"] for m in reversed(chat) if m["role"] == "user"), "") or ""
    line = next((ln for ln in text.splitlines() if ln.strip()), "")
    return " ".join(re.sub(r"\d+", "0", line.lower()).split())[:200]


def _beyond_template_cap(records: list[TrafficRecord], cap: int | None) -> set[str]:
    """Ids of the records beyond the newest ``cap`` of their template (``records`` oldest first)."""
    if cap is None:
        return set()
    kept: dict[str, int] = {}
    beyond = set()
    for r in reversed(records):
        key = template_key(r.chat())
        kept[key] = kept.get(key, 0) + 1
        if kept[key] > cap:
            beyond.add(r.id)
    return beyond


def _heldout_size(prompts: int, settings: RefreshSettings) -> int:
    """Distinct prompts the held-out slice holds, of ``prompts`` distinct prompts in the window."""
    return max(settings.min_heldout, math.ceil(settings.heldout_fraction * prompts))


def _heldout_start(usable: list[TrafficRecord], wanted: int) -> int:
    """Where the held-out slice starts: going back from the newest record until the slice holds ``wanted``
    distinct prompts, then earlier while the record before it shares the slice's oldest timestamp."""
    cut, prompts = len(usable), set()
    while cut > 0 and (len(prompts) < wanted or usable[cut - 1].received_at_dt == usable[cut].received_at_dt):
        cut -= 1
        prompts.add(_prompt_key(usable[cut].chat()))
    return cut


def select_traffic(records: Iterable[TrafficRecord], *, target_fingerprint: str,
                   settings: RefreshSettings, now: datetime | None = None) -> Selection:
    """Clean and split a traffic window (see the module docstring); records received at or after ``now``
    (when given: the refresh passes the time of its selection) are counted as ``future`` and left out.

    :class:`TrafficSelectionError` (naming the counts) unless at least ``min_heldout`` held-out
    records and one training record are left.
    """
    counts = dict.fromkeys(COUNT_KEYS, 0)
    usable = _clean(records, target_fingerprint, settings.dedupe, counts, now)
    if settings.max_records is not None and len(usable) > settings.max_records:
        counts["beyond_max_records"] = len(usable) - settings.max_records
        usable = usable[-settings.max_records:]
    counts["usable"] = len(usable)
    distinct = len({_prompt_key(r.chat()) for r in usable})
    size = _heldout_size(distinct, settings)
    if distinct <= size:
        raise TrafficSelectionError(
            f"too little usable traffic for a refresh: {len(usable)} usable records with {distinct} distinct prompts, "
            f"but the held-out slice alone needs {size} distinct prompts (refresh.min_heldout={settings.min_heldout}, "
            f"heldout_fraction={settings.heldout_fraction}) and training at least one more; "
            f"counts: {describe_counts(counts)}")
    cut = _heldout_start(usable, size)
    older, newest = usable[:cut], usable[cut:]

    heldout, heldout_prompts = [], set()
    for r in newest:
        key = _prompt_key(r.chat())
        if key in heldout_prompts:
            counts["heldout_duplicate_prompts"] += 1
            continue
        heldout_prompts.add(key)
        heldout.append(r)

    eligible = []
    for r in older:
        if _prompt_key(r.chat()) in heldout_prompts:
            counts["train_heldout_prompts"] += 1
            continue
        eligible.append(r)
    train, regenerate = [], []
    capped = _beyond_template_cap(eligible, settings.max_per_template)
    for r in eligible:
        if r.id in capped:
            counts["template_capped"] += 1
            continue
        if r.temperature > 0:
            counts["sampled"] += 1
            if settings.sampled_responses == "drop":
                counts["sampled_dropped"] += 1
                continue
            if settings.sampled_responses == "regenerate":
                counts["sampled_regenerate"] += 1
                regenerate.append(r)
        train.append(r)
    counts["heldout"], counts["train"] = len(heldout), len(train)
    if len(heldout) < settings.min_heldout or not train:
        what = (f"{len(heldout)} distinct held-out prompts < refresh.min_heldout={settings.min_heldout}"
                if len(heldout) < settings.min_heldout else "no training record is left")
        raise TrafficSelectionError(f"too little usable traffic for a refresh: {what}; counts: "
                                    f"{describe_counts(counts)}")
    return Selection(train, heldout, regenerate, counts, settings.sampled_responses)


def conversation_row(record: TrafficRecord) -> dict[str, Any]:
    """A training conversation: the request's messages, then the served response as the assistant turn."""
    return {"id": record.id, "messages": [*record.chat(), {"role": "assistant", "content": record.response_text}]}


def prompt_row(record: TrafficRecord) -> dict[str, Any]:
    """A held-out prompt (:mod:`peagle.evaluate.prompts` file row)."""
    return {"id": f"{HELDOUT_CATEGORY}/{record.id}", "messages": record.chat(), "category": HELDOUT_CATEGORY}


def _write_jsonl(path: Path, rows: Iterable[dict[str, Any]]) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        for row in rows:
            fh.write(json.dumps(row, ensure_ascii=False) + "\n")


def write_selection(selection: Selection, out_dir: str | Path) -> dict[str, Path]:
    """Write the selection's files into the local directory ``out_dir``; returns them by name.

    ``train.jsonl`` holds the records kept as served; those to regenerate go to ``regenerate.jsonl``.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    again = {r.id for r in selection.regenerate}
    paths = {name: out / name for name in (TRAIN_FILE, HELDOUT_FILE, COUNTS_FILE)}
    _write_jsonl(paths[TRAIN_FILE], (conversation_row(r) for r in selection.train if r.id not in again))
    _write_jsonl(paths[HELDOUT_FILE], (prompt_row(r) for r in selection.heldout))
    if selection.regenerate:
        paths[REGENERATE_FILE] = out / REGENERATE_FILE
        _write_jsonl(paths[REGENERATE_FILE], (conversation_row(r) for r in selection.regenerate))
    paths[COUNTS_FILE].write_text(json.dumps(selection.summary(), indent=1) + "\n", encoding="utf-8")
    return paths
