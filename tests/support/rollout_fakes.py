"""Test doubles of the rollout's serving side (peagle.rollout.controller's backend) and of served traffic, for
tests/unit/rollout/test_rollout_controller.py and tests/integration/helm/test_rollout_cluster_helm.py."""
from __future__ import annotations

from datetime import datetime, timedelta, timezone

from peagle.rollout.settings import RolloutSettings
from support.traffic_records import spec_decode, traffic_record, write_records

STABLE, GOOD, BAD, OTHER = "aaaaaaaaaaaa", "bbbbbbbbbbbb", "cccccccccccc", "dddddddddddd"
BETTER = "eeeeeeeeeeee"  # better than GOOD: a second promotion after GOOD's
TARGET = "f" * 12
T0 = datetime(2026, 3, 1, 12, 0, tzinfo=timezone.utc)
# acceptance histograms (steps with 0..3 accepted tokens) per draft: the good candidate accepts more
HISTOGRAMS = {STABLE: [4, 4, 4, 4], GOOD: [1, 3, 5, 7], BAD: [9, 4, 2, 1], OTHER: [4, 4, 4, 4], BETTER: [0, 1, 4, 11]}


class Killed(BaseException):
    """The process running the rollout was killed at this point (not an Exception: nothing catches it)."""


class MemoryBackend:
    """Test double of the serving side: which draft the stable serves, the canary and its share.

    ``kill_at = n``: the n-th call that changes something takes effect, then the process "dies"
    (:class:`Killed`). ``violations`` lists moments a backend with traffic was not serving."""

    def __init__(self, clock, stable: str = STABLE):
        self.clock, self.stable = clock, stable
        self.canary: str | None = None
        self.weight = 0
        self.started: datetime | None = None
        self.restarting = False
        self.calls: list[tuple] = []
        self.kill_at: int | None = None
        self.violations: list[str] = []

    def _changed(self, *call) -> None:
        self.calls.append(call)
        if len(self.calls) == self.kill_at:
            raise Killed(call)

    def stable_fingerprint(self):
        return self.stable

    def canary_fingerprint(self):
        return self.canary

    def canary_started_at(self):
        return self.started

    def deploy_canary(self, candidate, percent):
        self.canary, self.weight = candidate.fingerprint, percent
        self.started = self.started or self.clock()
        self._changed("deploy_canary", candidate.fingerprint, percent)

    def set_weight(self, candidate, percent):
        assert self.canary == candidate.fingerprint
        self.weight = percent
        self._changed("set_weight", percent)

    def update_stable(self, candidate):
        if self.stable != candidate.fingerprint and self.weight != 100:  # the same draft again: no restart
            self.violations.append(f"stable restarted with {100 - self.weight}% of the traffic")
        self.stable = candidate.fingerprint
        self._changed("update_stable", candidate.fingerprint)

    def remove_canary(self):
        self.canary, self.weight, self.started = None, 0, None
        self._changed("remove_canary")


class Served:
    """A clock and a ``sleep`` that lets traffic flow: each second of sleep, ``rate`` requests are served and
    captured into the traffic log, split between stable and canary by the backend's weight."""

    def __init__(self, log_dir, rate: int = 4):
        self.now, self.rate, self.log_dir = T0, rate, str(log_dir)
        self.backend: MemoryBackend | None = None

    def clock(self) -> datetime:
        return self.now

    def sleep(self, seconds: float) -> None:
        b = self.backend
        records = []
        for i in range(int(seconds * self.rate)):
            when = self.now + timedelta(seconds=i / self.rate)
            draft = b.canary if b.canary and (i % 100) < b.weight else b.stable
            records.append(traffic_record(
                f"q{i}", when=when, model="m", response_text="a", finish_reason="stop", target_fingerprint=TARGET,
                draft_fingerprint=draft,
                spec_decode=spec_decode(HISTOGRAMS[draft], 3 * sum(HISTOGRAMS[draft]), mean=2.0)))
        if records:
            write_records(None, records, uri=self.log_dir)
        self.now += timedelta(seconds=seconds)


SETTINGS = RolloutSettings(canary_percent=25, min_requests=20, window_s=600, poll_s=30, resamples=200)
