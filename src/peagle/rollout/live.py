"""Live acceptance of the stable and the candidate draft, from the traffic log's per-request records.

During a canary both drafts serve real traffic; every captured record names the draft that answered it
(``draft_fingerprint``) and carries vLLM's per-request acceptance histogram (``spec_decode``). A version's
live figures pool the histograms of its records received in ``[since, until)`` that were answered (status
200) with a histogram -- the same definitions as the gate (:func:`peagle.stats.acceptance_of_sums`):

* acceptance length ``AL = 1 + accepted / steps`` (``h[j]``: steps with ``j`` drafts accepted);
* first-position acceptance = steps whose first drafted token was accepted / steps.

* time per output token = request latency / output tokens, pooled (sum of latencies over sum of tokens) over
  the requests whose record has a usage; prefill is included, and both versions see the same mix of
  requests through the router, so slower decoding shows as a larger figure. ``seconds_per_token_ratio`` =
  candidate's over stable's.

Unlike the gate, the two versions answered *different* requests (the router split them), so the interval
of the difference comes from an unpaired percentile bootstrap: each version's requests are drawn with
replacement on their own (:func:`peagle.stats.acceptance_draws`; one seeded generator, stable's draws first),
and the difference is taken draw by draw. A version with no requests has figures of value None; one with a single request has no interval.
"""
from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Iterable, Sequence

import numpy as np

from ..records.identity import fingerprint_of
from ..records.live import CANDIDATE, ROLES, STABLE, LiveComparison, VersionFigures
from ..stats import (Estimate, acceptance_draws, acceptance_of_sums, finite_or_none, histogram_matrix,
                     percentile_interval, ratio_of_sums, ratio_of_sums_draws)
from ..records.traffic import TrafficRecord
from ..records.base import format_time



@dataclass
class _Group:
    """One version's requests: histograms padded to one width, latencies."""

    rows: np.ndarray  # [requests, K+1]
    latencies: list[float]
    timed: np.ndarray  # [requests with a usage, 2]: latency_s, output tokens

    @classmethod
    def of(cls, records: Sequence[TrafficRecord]) -> "_Group":
        timed = np.array([[float(r.timing["latency_s"]), float(r.usage["completion_tokens"])] for r in records
                          if r.usage and r.usage.get("completion_tokens", 0) > 0], dtype=np.float64).reshape(-1, 2)
        return cls(histogram_matrix([r.live_histogram for r in records]),
                   [float(r.timing["latency_s"]) for r in records], timed)

    @property
    def requests(self) -> int:
        return self.rows.shape[0]


def live_comparison(records: Iterable[TrafficRecord], *, stable_fingerprint: str, candidate_fingerprint: str,
                    since: datetime, until: datetime, level: float = 0.95, resamples: int = 1000,
                    seed: int = 0) -> LiveComparison:
    """Both versions' live figures over records received in ``[since, until)`` (see the module docstring).

    Records of other drafts (another fingerprint, or none) are ignored. ValueError when the two
    fingerprints are empty or equal (the versions could not be told apart)."""
    if not stable_fingerprint or not candidate_fingerprint or stable_fingerprint == candidate_fingerprint:
        raise ValueError(f"live comparison needs two different draft fingerprints, got stable "
                         f"{stable_fingerprint!r} and candidate {candidate_fingerprint!r}")
    by_role: dict[str, list[TrafficRecord]] = {STABLE: [], CANDIDATE: []}
    # records name a draft by its fingerprint or, written by an older peagle serve, its whole digest
    role_of = {fingerprint_of(stable_fingerprint): STABLE, fingerprint_of(candidate_fingerprint): CANDIDATE}
    for r in records:
        role = role_of.get(fingerprint_of(r.draft_fingerprint) or "")
        if role and r.live_histogram is not None and since <= r.received_at_dt < until:
            by_role[role].append(r)
    groups = {role: _Group.of(rs) for role, rs in by_role.items()}
    rng = np.random.default_rng(seed)
    # stable's first: the order is the seed's
    draws = {role: acceptance_draws(groups[role].rows, rng, resamples) for role in ROLES}
    # drawn after the acceptance draws, from the same generator: the acceptance figures stay as they were
    spt_draws = {role: ratio_of_sums_draws(groups[role].timed, rng, resamples) for role in ROLES}

    def interval(values: np.ndarray | None) -> tuple[float, float] | None:
        return percentile_interval(values, level=level, resamples=resamples)

    def figures(role: str, fingerprint: str) -> VersionFigures:
        g, d = groups[role], draws[role]
        al, first = acceptance_of_sums(g.rows.sum(axis=0))
        return VersionFigures(
            role, fingerprint, g.requests,
            Estimate(finite_or_none(al), interval(None if d is None else d[0])),
            Estimate(finite_or_none(first), interval(None if d is None else d[1])),
            float(np.median(g.latencies)) if g.latencies else None, int(g.rows.sum()),
            Estimate(finite_or_none(ratio_of_sums(g.timed)), interval(spt_draws[role])))

    stable, candidate = figures(STABLE, stable_fingerprint), figures(CANDIDATE, candidate_fingerprint)

    def difference(i: int, s: Estimate, c: Estimate) -> Estimate:
        value = None if s.value is None or c.value is None else c.value - s.value
        both = draws[STABLE] is not None and draws[CANDIDATE] is not None
        return Estimate(value, interval(draws[CANDIDATE][i] - draws[STABLE][i]) if both else None)

    s_spt, c_spt = stable.seconds_per_token.value, candidate.seconds_per_token.value
    ratio = Estimate(None if s_spt is None or c_spt is None or s_spt <= 0 else c_spt / s_spt,
                     interval(spt_draws[CANDIDATE] / spt_draws[STABLE])
                     if spt_draws[STABLE] is not None and spt_draws[CANDIDATE] is not None else None)
    return LiveComparison(stable, candidate,
                          difference(0, stable.acceptance_length, candidate.acceptance_length),
                          format_time(since), format_time(until), level, resamples,
                          difference(1, stable.first_position, candidate.first_position), ratio)
