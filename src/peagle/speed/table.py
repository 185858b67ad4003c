"""The speed table: per configuration and concurrency, throughput and latency, and ratios with intervals.

Input: the request records of :mod:`peagle.speed.loads`, per configuration (the target alone,
target + draft at a fixed K, target + draft with a schedule) and round. Rounds of one configuration
are pooled; the measurement interleaves configurations round by round, so a change of load on the
machine falls on all of them.

Figures of one configuration at concurrency ``c``, over its *steady* requests (``c`` in flight
throughout; the drain at the end of a load is left out):

* ``tokens_per_s`` -- output tokens per second of the whole engine, by Little's law with ``c``
  requests always in flight: ``c * sum(output tokens) / sum(end-to-end latency)``;
* ``tpot_s`` -- time per output token of a request after its first, ``(e2e - ttft) / (tokens - 1)``
  (p50, p90); ``ttft_s`` and ``e2e_s`` (p50, p90).

* ``step`` -- where an engine step's time went (:mod:`peagle.speed.step_costs`; only where the engine
  could be clocked): seconds per step in the target's forward, sampling and verification, the draft,
  and the rest, pooled over rounds (weighted by steps), and output tokens per step.

A ratio to the target alone (``speedup``) is the quotient of the two throughputs; its interval is a
percentile bootstrap resampling each side's requests with replacement (fixed seed), so it shows how
much the figure moves with which requests happened to be measured.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
from pydantic import Field, model_validator

from ..config import StrictModel

TARGET = "target"  # the configuration label of the target alone
SCHEDULE = "schedule"  # the configuration label of target + draft with the chosen schedule
RESAMPLES = 1000
LEVEL = 0.95


def k_label(k: int) -> str:
    return TARGET if k == 0 else f"K={k}"


class RequestTiming(StrictModel):
    """One request of the load ladder, as the client saw it."""

    config: str
    round: int = Field(ge=0)
    concurrency: int = Field(ge=1)
    index: int = Field(ge=0)
    prompt_tokens: int = Field(ge=0)
    output_tokens: int = Field(ge=0)
    ttft_s: float = Field(ge=0)
    e2e_s: float = Field(ge=0)
    steady: bool

    @property
    def tpot_s(self) -> float | None:
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1) if self.output_tokens > 1 else None


class Quantiles(StrictModel):
    p50: float | None
    p90: float | None


class Ratio(StrictModel):
    """A ratio of two throughputs and its bootstrap interval (``level``)."""

    value: float
    low: float
    high: float
    level: float = LEVEL

    @model_validator(mode="after")
    def _ordered(self) -> "Ratio":
        if not self.low <= self.value <= self.high:
            raise ValueError(f"ratio {self.value} outside its interval [{self.low}, {self.high}]")
        return self


class _StepParts(StrictModel):
    """Mean seconds per engine step, by part (:mod:`peagle.speed.step_costs`)."""

    steps: int = Field(ge=0)
    step_s: float = Field(ge=0)
    target_s: float = Field(ge=0, description="the target's forward and logits (with a draft: verification)")
    sample_s: float = Field(ge=0, description="sampling; with a draft, the rejection sampler")
    draft_s: float = Field(ge=0, description="the draft's forward(s), K = 0 included")
    other_s: float = Field(ge=0, description="the rest: scheduling, input preparation, output processing")


STEP_SECONDS = ("step_s", "target_s", "sample_s", "draft_s", "other_s")


class StepCosts(_StepParts):
    """The step costs of one configuration at one load, its rounds pooled."""

    tokens_per_step: float | None = Field(None, description="output tokens of the load over its engine steps")


class StepSample(_StepParts):
    """One round's step costs of one configuration at one load, as the child reported them."""

    config: str
    round: int = Field(ge=0)
    concurrency: int = Field(ge=1)


class LoadPoint(StrictModel):
    """One configuration at one concurrency."""

    config: str
    concurrency: int = Field(ge=1)
    requests: int = Field(ge=0, description="steady requests counted")
    rounds: int = Field(ge=1)
    output_tokens: int = Field(ge=0)
    tokens_per_s: float | None
    tpot_s: Quantiles
    ttft_s: Quantiles
    e2e_s: Quantiles
    speedup: Ratio | None = Field(None, description="tokens_per_s over the target alone's, same concurrency")
    step: StepCosts | None = Field(None, description="where an engine step's time went (null: not clocked)")


class SpeedTable(StrictModel):
    """Every configuration at every measured concurrency (the evaluation's ``speed`` section)."""

    concurrencies: list[int]
    configs: list[str]
    points: list[LoadPoint]
    max_tokens: int = Field(ge=1)
    prompts: int = Field(ge=1)
    rounds: int = Field(ge=1)
    device: str | None = None

    def point(self, config: str, concurrency: int) -> LoadPoint | None:
        return next((p for p in self.points if p.config == config and p.concurrency == concurrency), None)

    def speedups(self, config: str) -> dict[int, Ratio | None]:
        return {c: (p.speedup if (p := self.point(config, c)) else None) for c in self.concurrencies}


def _quantiles(values: Sequence[float]) -> Quantiles:
    if not values:
        return Quantiles(p50=None, p90=None)
    a = np.asarray(values, dtype=np.float64)
    return Quantiles(p50=float(np.percentile(a, 50)), p90=float(np.percentile(a, 90)))


def _throughput(c: int, tokens: np.ndarray, e2e: np.ndarray) -> np.ndarray:
    """c * sum(tokens) / sum(e2e) along the last axis."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return c * tokens.sum(axis=-1) / e2e.sum(axis=-1)


def ratio_interval(c: int, mine: Sequence[RequestTiming], base: Sequence[RequestTiming], *, seed: int = 0,
                   resamples: int = RESAMPLES, level: float = LEVEL) -> Ratio | None:
    """Throughput ratio ``mine / base`` at concurrency ``c`` with its percentile bootstrap interval."""
    if not mine or not base:
        return None
    rng = np.random.default_rng(seed)
    arrays = []
    for side in (mine, base):
        tok = np.array([r.output_tokens for r in side], dtype=np.float64)
        e2e = np.array([r.e2e_s for r in side], dtype=np.float64)
        pick = rng.integers(0, len(side), size=(resamples, len(side)))
        arrays.append((_throughput(c, tok, e2e), _throughput(c, tok[pick], e2e[pick])))
    (point_m, boot_m), (point_b, boot_b) = arrays
    if not point_b > 0:
        return None
    boot = boot_m / boot_b
    boot = boot[np.isfinite(boot)]
    value = float(point_m / point_b)
    lo, hi = np.percentile(boot, [(1 - level) / 2 * 100, (1 + level) / 2 * 100])
    return Ratio(value=value, low=min(float(lo), value), high=max(float(hi), value), level=level)


def pooled_steps(samples: Sequence[StepSample], output_tokens: int) -> StepCosts | None:
    """Rounds pooled, each weighted by its steps; ``output_tokens``: all the load's tokens in those rounds."""
    steps = sum(s.steps for s in samples)
    if not steps:
        return None
    mean = {k: sum(getattr(s, k) * s.steps for s in samples) / steps for k in STEP_SECONDS}
    return StepCosts(steps=steps, **mean, tokens_per_step=output_tokens / steps)


def build_table(timings: Iterable[RequestTiming], *, max_tokens: int, prompts: int,
                device: str | None = None, steps: Iterable[StepSample] = ()) -> SpeedTable:
    """Pool the rounds of each configuration and concurrency; ratios against :data:`TARGET`.
    ``steps``: the step costs the child clocked, if any."""
    timings = list(timings)
    steps = list(steps)
    if not timings:
        raise ValueError("no request was timed")
    configs = list(dict.fromkeys(t.config for t in timings))
    configs.sort(key=lambda c: (c != TARGET, c == SCHEDULE, int(c[2:]) if c.startswith("K=") else 0))
    concurrencies = sorted({t.concurrency for t in timings})
    steady: dict[tuple[str, int], list[RequestTiming]] = {}
    for t in timings:
        if t.steady:
            steady.setdefault((t.config, t.concurrency), []).append(t)
    points = []
    for cfg in configs:
        for c in concurrencies:
            rows = steady.get((cfg, c), [])
            all_rows = [t for t in timings if t.config == cfg and t.concurrency == c]
            if not all_rows:
                continue
            tok = np.array([r.output_tokens for r in rows], dtype=np.float64)
            e2e = np.array([r.e2e_s for r in rows], dtype=np.float64)
            tps = float(_throughput(c, tok, e2e)) if rows and e2e.sum() > 0 else None
            base = steady.get((TARGET, c), [])
            clocked = [s for s in steps if s.config == cfg and s.concurrency == c]
            clocked_rounds = {s.round for s in clocked}
            points.append(LoadPoint(
                config=cfg, concurrency=c, requests=len(rows), rounds=len({r.round for r in all_rows}),
                output_tokens=int(tok.sum()), tokens_per_s=tps,
                tpot_s=_quantiles([r.tpot_s for r in rows if r.tpot_s is not None]),
                ttft_s=_quantiles([r.ttft_s for r in rows]), e2e_s=_quantiles([r.e2e_s for r in rows]),
                speedup=None if cfg == TARGET else ratio_interval(c, rows, base, seed=c),
                step=pooled_steps(clocked, sum(r.output_tokens for r in all_rows if r.round in clocked_rounds))))
    return SpeedTable(concurrencies=concurrencies, configs=configs, points=points, max_tokens=max_tokens,
                      prompts=prompts, rounds=max(t.round for t in timings) + 1, device=device)


def timings_of(config: str, round_: int, records: Iterable[dict[str, Any]]) -> list[RequestTiming]:
    """The child's request records (:func:`peagle.speed.loads.run_ladder`) as typed timings."""
    return [RequestTiming(config=config, round=round_, **r) for r in records]


def steps_of(config: str, round_: int, by_load: dict[str, dict[str, Any]] | None) -> list[StepSample]:
    """The child's ``step_costs`` (per concurrency, :mod:`peagle.speed.step_costs`) as typed samples."""
    return [StepSample(config=config, round=round_, concurrency=int(c), **v) for c, v in (by_load or {}).items()]
