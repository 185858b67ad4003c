"""The speculation schedule: K per batch-size range, chosen from the speed table, and how vLLM serves it.

vLLM 0.32 reads ``speculative_config["num_speculative_tokens_per_batch_size"]``: inclusive ranges
``[lo, hi, K]``, sorted, non-overlapping, the first starting at 1, ``K >= 0`` (0: no drafting at that
batch size); a batch size past the last range keeps the last K, and every K is capped by
``num_speculative_tokens`` (``vllm/v1/spec_decode/dynamic/utils.py``: the scheduler looks K up by the
number of requests it schedules in a step). :class:`SpeculationSchedule` holds the same ranges, checked
by the same rules when it is built, with what was measured for each.

The choice (:func:`choose_schedule`): at each measured concurrency, among the K that win beyond noise
(the lower end of the ratio's interval to the target alone above 1), the smallest whose interval reaches
the best one's ratio; K = 0 where none wins. Smallest, because the largest K of a schedule costs time
even where it drafts nothing: with parallel drafting vLLM pads every request of the draft's forward to
``num_speculative_tokens`` slots, K = 0 included (``extra_slots_per_request`` in
``vllm/v1/spec_decode/llm_base_proposer.py``). Measured on the embedded default (2-core CPU, 16 in
flight, three rounds): ``[[1, 1, 1], [2, 16, 0]]`` served at 0.95x the target alone,
``[[1, 1, 2], [2, 16, 0]]`` at 0.89x. A batch size between two measured concurrencies takes the K of the higher
one (speculation pays less as the batch grows, so that is the cautious side); neighbouring ranges with
one K merge. Serving it (:meth:`SpeculationSchedule.speculative_config`):

* K = 0 everywhere -> no draft at all (the target alone is what was measured fastest);
* one K everywhere -> a plain ``num_speculative_tokens``;
* otherwise -> ``num_speculative_tokens`` = the largest K, and the ranges.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from ..config import StrictModel
from .table import SCHEDULE, TARGET, Ratio, SpeedTable

SCHEDULE_FORMAT = "peagle.speed.schedule/v1"
SCHEDULE_FILE = "schedule.json"
PUBLISHED_KIND = "peagle-evaluation"  # the evaluate output holds it (peagle.evaluate.report.EVALUATION_KIND)
RULE = ("at each measured concurrency, among the K whose throughput ratio to the target alone has its lower bound "
        "above 1, the smallest whose interval reaches the best ratio, else 0; between measured concurrencies the K "
        "of the next higher one")


class ScheduleRange(StrictModel):
    """Batch sizes ``lo..hi`` (inclusive) draft ``k`` tokens per step."""

    lo: int = Field(ge=1)
    hi: int = Field(ge=1)
    k: int = Field(ge=0)

    @model_validator(mode="after")
    def _ordered(self) -> "ScheduleRange":
        if self.lo > self.hi:
            raise ValueError(f"range start {self.lo} is above its end {self.hi}")
        return self


class MeasuredLoad(StrictModel):
    """What the schedule does at one measured concurrency."""

    concurrency: int = Field(ge=1)
    k: int = Field(ge=0, description="K the schedule drafts at this batch size")
    chosen_from: Ratio | None = Field(None, description="that K's ratio to the target alone in the sweep "
                                      "(null: K = 0)")
    served: Ratio | None = Field(None, description="the schedule's own ratio, vLLM serving it (null: not measured)")


class SpeculationSchedule(StrictModel):
    """``schedule.json``: the speculation length per batch size, and the speed measured for it."""

    format: Literal["peagle.speed.schedule/v1"] = SCHEDULE_FORMAT
    draft_sha256: str | None = Field(None, description="the draft it was measured with")
    max_batch_size: int = Field(ge=1, description="the engine's max_num_seqs the ranges cover")
    ranges: list[ScheduleRange]
    measured: list[MeasuredLoad] = Field(default_factory=list)
    rule: str = RULE
    device: str | None = None

    @model_validator(mode="after")
    def _like_vllm(self) -> "SpeculationSchedule":
        # vLLM's own rules (validate_and_normalize_dynamic_sd_schedule), plus: contiguous and covering
        # 1..max_batch_size, so every batch size reads its K here without vLLM's carry-forward.
        if not self.ranges:
            raise ValueError("ranges must not be empty")
        if self.ranges[0].lo != 1:
            raise ValueError(f"the first range must start at 1 (vLLM), got {self.ranges[0].lo}")
        for a, b in zip(self.ranges, self.ranges[1:]):
            if b.lo != a.hi + 1:
                raise ValueError(f"ranges must be sorted and contiguous: [{a.lo}, {a.hi}] then [{b.lo}, {b.hi}]")
        if self.ranges[-1].hi < self.max_batch_size:
            raise ValueError(f"the last range ends at {self.ranges[-1].hi}, below max_batch_size "
                             f"{self.max_batch_size}")
        return self

    @property
    def num_speculative_tokens(self) -> int:
        """vLLM's ``num_speculative_tokens``: the largest K (0: serve no draft)."""
        return max(r.k for r in self.ranges)

    @property
    def single_k(self) -> int | None:
        """The K of every batch size when there is one (0 included), else None."""
        ks = {r.k for r in self.ranges}
        return ks.pop() if len(ks) == 1 else None

    def k_at(self, batch_size: int) -> int:
        return next((r.k for r in self.ranges if r.lo <= batch_size <= r.hi), self.ranges[-1].k)

    def vllm_ranges(self) -> list[list[int]]:
        """``num_speculative_tokens_per_batch_size`` as vLLM reads it."""
        return [[r.lo, r.hi, r.k] for r in self.ranges]

    def speculative_config(self, draft: str) -> dict[str, Any] | None:
        """vLLM's long-form speculative config serving this schedule with ``draft``; None: serve no draft."""
        k = self.num_speculative_tokens
        if k == 0:
            return None
        cfg: dict[str, Any] = {"method": "eagle3", "model": str(draft), "num_speculative_tokens": k,
                               "parallel_drafting": True}
        if self.single_k is None:
            cfg["num_speculative_tokens_per_batch_size"] = self.vllm_ranges()
        return cfg

    def describe(self) -> str:
        """One line: ``1-2: K=2, 3-16: off``."""
        return ", ".join(f"{r.lo}-{r.hi}: " + (f"K={r.k}" if r.k else "off") for r in self.ranges)

    def to_json(self) -> str:
        return json.dumps(self.model_dump(mode="json"), indent=2) + "\n"

    @classmethod
    def read(cls, location: str | Path) -> "SpeculationSchedule":
        """The schedule at ``location``: a ``schedule.json``, or an evaluate output (a directory, ``file://``
        or ``s3://`` prefix) holding one; a published output is read through its manifest (checksum
        verified). ScheduleError naming it otherwise."""
        from ..stage_io import read_output_document
        from .errors import ScheduleError, one_line

        def parse(doc, where: str) -> "SpeculationSchedule":
            try:
                return cls.model_validate(doc)
            except ValueError as exc:
                raise ScheduleError(f"{where}: not a speculation schedule: {one_line(exc)}") from None

        return read_output_document(location, SCHEDULE_FILE, PUBLISHED_KIND, "the speculation schedule", parse,
                                    ScheduleError)


def choose_schedule(table: SpeedTable, max_batch_size: int, *, draft_sha256: str | None = None) -> SpeculationSchedule:
    """The schedule the table argues for (see the module docstring); ``max_batch_size``: the engine's
    ``max_num_seqs``, which the last range reaches."""
    ks = sorted(int(c[2:]) for c in table.configs if c.startswith("K="))
    if not ks:
        raise ValueError("the speed table has no configuration with a draft")
    chosen: list[tuple[int, int, Ratio | None]] = []
    for c in table.concurrencies:
        winners = [(k, r) for k in ks if (p := table.point(f"K={k}", c)) is not None
                   and (r := p.speedup) is not None and r.low > 1.0]
        if not winners:
            chosen.append((c, 0, None))
            continue
        best = max(r.value for _, r in winners)
        k, r = next((k, r) for k, r in winners if r.high >= best)  # ks ascending: the smallest within noise
        chosen.append((c, k, r))
    ranges: list[ScheduleRange] = []
    lo = 1
    for i, (c, k, _) in enumerate(chosen):
        hi = max_batch_size if i == len(chosen) - 1 else c
        hi = max(hi, lo)
        if ranges and ranges[-1].k == k:
            ranges[-1] = ScheduleRange(lo=ranges[-1].lo, hi=hi, k=k)
        else:
            ranges.append(ScheduleRange(lo=lo, hi=hi, k=k))
        lo = hi + 1
        if lo > max_batch_size:
            break
    measured = [MeasuredLoad(concurrency=c, k=k, chosen_from=r) for c, k, r in chosen]
    return SpeculationSchedule(draft_sha256=draft_sha256, max_batch_size=max_batch_size, ranges=ranges,
                               measured=measured, device=table.device)


def given_schedule(ranges: list[list[int]], table: SpeedTable, max_batch_size: int, *,
                   draft_sha256: str | None = None) -> SpeculationSchedule:
    """A schedule given by hand (``evaluate.speed.schedule``), with the sweep's ratio of each K it picks."""
    from .errors import ScheduleError, one_line

    try:
        rs = [ScheduleRange(lo=int(a), hi=int(b), k=int(k)) for a, b, k in ranges]
        rs[-1] = rs[-1].model_copy(update={"hi": max(rs[-1].hi, max_batch_size)})
        probe = SpeculationSchedule(max_batch_size=max_batch_size, ranges=rs)
    except (ValueError, TypeError) as exc:
        raise ScheduleError(f"evaluate.speed.schedule {ranges}: {one_line(exc)}") from None
    measured = []
    for c in table.concurrencies:
        k = probe.k_at(c)
        p = table.point(f"K={k}", c) if k else None
        measured.append(MeasuredLoad(concurrency=c, k=k, chosen_from=p.speedup if p is not None else None))
    return probe.model_copy(update={"draft_sha256": draft_sha256, "measured": measured, "device": table.device,
                                    "rule": "given (evaluate.speed.schedule)"})


def with_served(schedule: SpeculationSchedule, table: SpeedTable) -> SpeculationSchedule:
    """The schedule with its own measured ratio at each concurrency (the table's :data:`SCHEDULE` rows;
    where the schedule drafts nothing, the target alone is served and its ratio is 1 by definition)."""
    measured = []
    for m in schedule.measured:
        p = table.point(SCHEDULE, m.concurrency)
        measured.append(m.model_copy(update={"served": p.speedup if p is not None else None}))
    return schedule.model_copy(update={"measured": measured})


__all__ = ["SCHEDULE_FILE", "SCHEDULE_FORMAT", "MeasuredLoad", "ScheduleRange", "SpeculationSchedule",
           "TARGET", "choose_schedule", "with_served"]
