"""The loop history (rollout.history): append-only documents per kind, in time order, on a local store and on
real S3 (SeaweedFS); beside the traffic log without disturbing it."""
from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone

import pytest

from peagle.rollout.history import (KINDS, LoopHistory, LoopHistoryError, history_uri)
from peagle.rollout.settings import RolloutSettings
from peagle.traffic.log import TrafficLog, TrafficWriter
from peagle.traffic.record import TrafficRecord
from peagle.traffic.settings import CaptureSettings
from seaweed import BUCKET, unique

T0 = datetime(2026, 3, 1, 12, 0, tzinfo=timezone.utc)


class Clock:
    """A clock the test sets (the history takes any ``() -> datetime``)."""

    def __init__(self, now: datetime = T0):
        self.now = now

    def __call__(self) -> datetime:
        return self.now


def test_append_all_latest_in_time_order(tmp_path):
    clock = Clock()
    history = LoopHistory(str(tmp_path / "loop"), clock=clock)
    keys = []
    for i in range(3):
        keys.append(history.append("decision", {"i": i}))
        clock.now += timedelta(minutes=1)
    history.append("refresh", {"r": 0})
    assert keys[0].startswith("decision/20260301T120000000000Z-") and keys[0].endswith(".json")
    assert history.keys("decision") == keys
    assert [d["i"] for d in history.all("decision")] == [0, 1, 2]
    assert history.latest("decision") == {"i": 2}
    assert history.latest("decision", where=lambda d: d["i"] < 2) == {"i": 1}
    assert history.latest("decision", where=lambda d: d["i"] > 5) is None
    assert history.latest("promotion") is None and history.all("promotion") == []
    assert history.all("refresh") == [{"r": 0}]
    assert LoopHistory.appended_at(keys[1]) == T0 + timedelta(minutes=1)


def test_appends_in_the_same_instant_or_after_the_clock_stepped_back_keep_their_order(tmp_path):
    clock = Clock()
    history = LoopHistory(tmp_path, clock=clock)
    for i in range(5):
        history.append("promotion", {"i": i})
        if i == 2:
            clock.now -= timedelta(hours=1)
    assert [d["i"] for d in history.all("promotion")] == [0, 1, 2, 3, 4]
    # a second writer later on reads the first one's documents in order too
    later = LoopHistory(tmp_path, clock=Clock(T0 + timedelta(days=1)))
    later.append("promotion", {"i": 5})
    assert [d["i"] for d in LoopHistory(tmp_path).all("promotion")] == list(range(6))


def test_documents_are_readable_json_files_and_foreign_files_are_passed_over(tmp_path):
    history = LoopHistory(tmp_path)
    key = history.append("refresh", {"window": {"since": "a", "until": "b"}, "text": "naïve"})
    assert json.loads((tmp_path / key).read_text(encoding="utf-8"))["text"] == "naïve"
    (tmp_path / "refresh" / "README.txt").write_text("notes")
    assert history.keys("refresh") == [key]


def test_a_damaged_document_is_an_error_naming_its_key(tmp_path):
    history = LoopHistory(tmp_path)
    history.append("decision", {"i": 0})
    bad = history.append("decision", {"i": 1})
    (tmp_path / bad).write_text('{"i": 1')  # cut short
    with pytest.raises(LoopHistoryError, match=f"loop history document .*{bad} is damaged"):
        history.latest("decision")
    with pytest.raises(LoopHistoryError, match=bad):
        history.all("decision")
    (tmp_path / bad).write_text("[1, 2]")
    with pytest.raises(LoopHistoryError, match=f"{bad} is damaged: a JSON list, not an object"):
        history.latest("decision")


def test_unknown_kind_and_non_dict_documents_are_refused(tmp_path):
    history = LoopHistory(tmp_path)
    for call in (lambda: history.append("decisions", {}), lambda: history.latest("rollouts"),
                 lambda: history.all("x")):
        with pytest.raises(ValueError, match="unknown loop history kind '.*' \\(one of refresh, decision, promotion"):
            call()
    with pytest.raises(TypeError, match="a loop history document is a dict"):
        history.append("refresh", [1])  # type: ignore[arg-type]
    assert KINDS == ("refresh", "decision", "promotion")


def test_history_uri_defaults_under_the_traffic_log(tmp_path):
    assert history_uri(RolloutSettings(), "s3://traffic/qwen3/") == "s3://traffic/qwen3/_loop"
    assert history_uri(RolloutSettings(), str(tmp_path)) == str(tmp_path / "_loop")
    assert history_uri(RolloutSettings(history="s3://loop/h"), "s3://traffic/q") == "s3://loop/h"


def test_the_default_history_beside_the_traffic_log_leaves_the_log_alone(tmp_path):
    settings = CaptureSettings(enabled=True, uri=str(tmp_path), flush_interval_s=0.05, retention_days=0)
    writer = TrafficWriter(settings)
    writer.submit(TrafficRecord.new(received_at=T0, endpoint="/v1/chat/completions",
                                    messages=[{"role": "user", "content": "hi"}]))
    assert writer.close()
    history = LoopHistory(history_uri(RolloutSettings(), str(tmp_path)), clock=Clock(T0 - timedelta(days=30)))
    history.append("refresh", {"old": True})
    log = TrafficLog(str(tmp_path))
    assert len(log.records()) == 1
    log.apply_retention(1, now=T0 + timedelta(days=10))  # the batch goes; the history stays
    assert log.records() == [] and history.all("refresh") == [{"old": True}]


def test_on_real_s3(seaweed_server, monkeypatch):
    for k, v in seaweed_server.env().items():
        monkeypatch.setenv(k, v)
    uri = f"s3://{BUCKET}/{unique('loop')}"
    clock = Clock()
    history = LoopHistory(uri, clock=clock)
    for i in range(3):
        history.append("promotion", {"i": i})
        clock.now += timedelta(seconds=1)
    assert history.uri.startswith(f"s3://{BUCKET}/")
    assert [d["i"] for d in LoopHistory(uri).all("promotion")] == [0, 1, 2]
    assert LoopHistory(uri).latest("promotion", where=lambda d: d["i"] == 1) == {"i": 1}
    key = history.keys("promotion")[-1]
    seaweed_server.client().put_object(Bucket=BUCKET, Key=f"{uri.split('/', 3)[3]}/{key}", Body=b"\x00garbage")
    with pytest.raises(LoopHistoryError, match=f"s3://{BUCKET}/.*/{key} is damaged"):
        history.latest("promotion")
