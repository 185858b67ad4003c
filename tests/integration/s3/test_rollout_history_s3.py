"""The loop history (peagle.records.history) on real S3 (SeaweedFS): appends read back in order, and a
damaged document is an error naming its key. (On a local store: tests/unit/rollout/test_rollout_history.py.)"""
from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from peagle.records.history import LoopHistory, LoopHistoryError
from support.loop_records import refresh_entry
from support.seaweed import BUCKET, unique

T0 = datetime(2026, 3, 1, 12, 0, tzinfo=timezone.utc)


class Clock:
    """A clock the test sets (the history takes any ``() -> datetime``)."""

    def __init__(self, now: datetime = T0):
        self.now = now

    def __call__(self) -> datetime:
        return self.now


def test_on_real_s3(seaweed_server, monkeypatch):
    for k, v in seaweed_server.env().items():
        monkeypatch.setenv(k, v)
    uri = f"s3://{BUCKET}/{unique('loop')}"
    clock = Clock()
    history = LoopHistory(uri, clock=clock)
    for i in range(3):
        history.append("refresh", refresh_entry(i))
        clock.now += timedelta(seconds=1)
    assert history.uri.startswith(f"s3://{BUCKET}/")
    assert [d["rows"]["train"] for d in LoopHistory(uri).all("refresh")] == [0, 1, 2]
    assert LoopHistory(uri).latest("refresh", where=lambda d: d["rows"]["train"] == 1) == refresh_entry(1).to_dict()
    key = history.keys("refresh")[-1]
    seaweed_server.client().put_object(Bucket=BUCKET, Key=f"{uri.split('/', 3)[3]}/{key}", Body=b"\x00garbage")
    with pytest.raises(LoopHistoryError, match=f"s3://{BUCKET}/.*/{key} is damaged"):
        history.latest("refresh")
