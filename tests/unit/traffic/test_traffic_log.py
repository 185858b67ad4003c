"""The traffic log (issue #27): TrafficWriter batching, bounded non-blocking queue, kill -9 safety,
redaction on the stored bytes (local and real S3), retention, and the TrafficLog reader."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from peagle.storage import LocalStore, StorageError, publish
from peagle.traffic.log import BATCH_FORMAT, TrafficLog, TrafficLogError, TrafficWriter, batch_prefix
from peagle.records.traffic import TrafficRecord
from peagle.records.base import format_time
from peagle.traffic.settings import CaptureSettings
from support.traffic_records import (SECRETS, assert_redacted, secret_record, traffic_record,
                                     write_records as write)
from support.traffic_records import capture_settings as settings

T0 = datetime(2026, 3, 1, 12, 0, tzinfo=timezone.utc)


def record(i: int = 0, when: datetime | None = None, text: str = "hello") -> TrafficRecord:
    return traffic_record(f"{text} {i}", when=when, model="m", sampling={"seq": i}, response_text=f"answer {i}",
                          finish_reason="stop")


def stored_bytes(root: Path) -> bytes:
    return b"".join(p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file())


class SlowStore(LocalStore):
    """A local store whose writes take ``delay`` seconds (a slow or distant object store)."""

    def __init__(self, root, delay: float):
        super().__init__(root, fsync=False)
        self.delay = delay

    def _put_bytes(self, key, data):
        time.sleep(self.delay)
        super()._put_bytes(key, data)


class BrokenStore(LocalStore):
    def _put_bytes(self, key, data):
        raise StorageError(f"{self.uri_for(key)}: store unreachable")


# -- writing and reading ---------------------------------------------------------------------
def test_batches_by_size_then_interval_in_the_documented_layout(tmp_path):
    records = [record(i, T0 + timedelta(seconds=i)) for i in range(12)]
    writer = write(LocalStore(tmp_path), records, batch_records=5)
    assert writer.stats()["written_batches"] == 3 and writer.stats()["written_records"] == 12
    log = TrafficLog(str(tmp_path))
    batches = log.batches()
    assert [b.records for b in batches] == [5, 5, 2]
    first = batches[0]
    assert first.prefix.startswith("2026-03-01/12/20260301T120000000000Z-")
    assert first.first_received_at == T0 and first.last_received_at == T0 + timedelta(seconds=4)
    manifest = json.loads((tmp_path / first.prefix / "_MANIFEST.json").read_text())
    assert manifest["metadata"]["format"] == BATCH_FORMAT and manifest["metadata"]["dropped_total"] == 0
    assert log.records() == records


def test_records_window_is_since_inclusive_until_exclusive(tmp_path):
    records = [record(i, T0 + timedelta(hours=i)) for i in range(6)]
    write(LocalStore(tmp_path), records, batch_records=2)
    log = TrafficLog(str(tmp_path))
    got = log.records(since=T0 + timedelta(hours=1), until=T0 + timedelta(hours=4))
    assert [r.sampling["seq"] for r in got] == [1, 2, 3]
    assert [b.records for b in log.batches(since=T0 + timedelta(hours=1), until=T0 + timedelta(hours=4))] == [2, 2]
    assert log.records(since=T0 + timedelta(days=1)) == []


def test_garbage_line_names_the_batch_and_line(tmp_path):
    store = LocalStore(tmp_path)
    prefix = batch_prefix(T0)
    body = record(0, T0).to_json_line() + b"{not json\n"
    publish(store, prefix, {"records.jsonl": body},
            {"format": BATCH_FORMAT, "records": 2, "first_received_at": format_time(T0),
             "last_received_at": format_time(T0), "dropped_total": 0, "target_fingerprint": None,
             "draft_fingerprint": None})
    with pytest.raises(TrafficLogError, match=rf"{prefix}/records.jsonl line 2: not JSON"):
        TrafficLog(str(tmp_path)).records()


def test_unpublished_batch_is_ignored(tmp_path):
    write(LocalStore(tmp_path), [record(0, T0)])
    partial = tmp_path / batch_prefix(T0 + timedelta(minutes=1))
    partial.mkdir(parents=True)
    (partial / "records.jsonl").write_bytes(record(1).to_json_line())
    assert len(TrafficLog(str(tmp_path)).records()) == 1


def test_fingerprints_are_recorded_from_the_settings(tmp_path):
    write(LocalStore(tmp_path), [record(0, T0)], target_fingerprint="t" * 64, draft_fingerprint="d" * 64)
    (got,) = TrafficLog(str(tmp_path)).records()
    assert (got.target_fingerprint, got.draft_fingerprint) == ("t" * 64, "d" * 64)
    assert TrafficLog(str(tmp_path)).batches()[0].target_fingerprint == "t" * 64


def test_fingerprints_are_computed_once_from_the_served_directories(tmp_path):
    target, draft = tmp_path / "target", tmp_path / "draft"
    target.mkdir(), draft.mkdir()
    (target / "config.json").write_text('{"model_type": "llama"}')
    (draft / "config.json").write_text("{}")
    (draft / "model.safetensors").write_bytes(b"weights")
    write(LocalStore(tmp_path / "log"), [record(0, T0), record(1, T0)], target_dir=str(target), draft_dir=str(draft),
          batch_records=1)
    write(LocalStore(tmp_path / "log2"), [record(2, T0)], target_dir="org/hub-id")
    from peagle.records.identity import identify_draft
    from peagle.model.target import fingerprint
    got = TrafficLog(str(tmp_path / "log")).records()
    expected = (fingerprint(target), identify_draft(draft).fingerprint)
    assert {(r.target_fingerprint, r.draft_fingerprint) for r in got} == {expected}
    assert TrafficLog(str(tmp_path / "log2")).records()[0].target_fingerprint is None


# -- redaction before anything is written (on real S3: tests/integration/s3/test_traffic_log_s3.py) ----------
def test_redaction_on_the_bytes_of_a_local_store(tmp_path):
    write(LocalStore(tmp_path), [secret_record()])
    assert_redacted(stored_bytes(tmp_path))
    (got,) = TrafficLog(str(tmp_path)).records()
    assert got.redacted == 2 * len(SECRETS) + 1


def test_burst_beyond_the_queue_drops_counts_and_never_blocks(tmp_path):
    writer = TrafficWriter(settings(queue_records=50, batch_records=10), SlowStore(tmp_path, 0.1))
    depths, stop = [], threading.Event()

    def watch():
        while not stop.is_set():
            depths.append(writer.stats()["queue_depth"])
            time.sleep(0.001)

    watcher = threading.Thread(target=watch)
    watcher.start()
    calls, accepted = [], 0
    for i in range(3000):
        t = time.perf_counter()
        accepted += writer.submit(record(i))
        calls.append(time.perf_counter() - t)
    stop.set()
    watcher.join()
    stats = writer.stats()
    # A submit that waited for the store would take a whole flush (3 writes of 0.1 s); allow scheduling noise.
    assert max(calls) < 0.1, f"submit took {max(calls) * 1000:.1f} ms"
    assert stats["dropped_queue_full"] > 0 and accepted + stats["dropped_queue_full"] == 3000
    assert max(depths) <= 50 and stats["queue_depth"] <= 50
    assert writer.close(60)
    assert writer.stats()["written_records"] == accepted


def test_sample_rate_and_size_limit_are_counted(tmp_path):
    writer = write(LocalStore(tmp_path), [], sample_rate=0.0)
    assert not writer.submit(record(0)) and writer.stats()["sampled_out"] == 1
    big = TrafficRecord.new(endpoint="/v1/completions", prompt="x" * 5000)
    writer = write(LocalStore(tmp_path), [big, record(1)], max_record_bytes=2048)
    assert writer.stats()["dropped_too_large"] == 1 and writer.stats()["written_records"] == 1


def test_failing_store_is_counted_never_raised(tmp_path):
    writer = write(BrokenStore(tmp_path), [record(i) for i in range(3)], batch_records=2)
    stats = writer.stats()
    assert stats["write_errors"] == 2 and stats["dropped_write_error"] == 3 and stats["written_records"] == 0


# -- kill -9 ---------------------------------------------------------------------------------
CHILD = """
import os, signal, sys, time
from peagle.storage import LocalStore
from peagle.traffic.log import TrafficWriter
from peagle.records.traffic import TrafficRecord
from peagle.traffic.settings import CaptureSettings

class Store(LocalStore):
    batches = 0
    def _put_bytes(self, key, data):
        time.sleep(float(sys.argv[2]))
        if key.endswith("_MANIFEST.json"):
            Store.batches += 1
            if Store.batches == int(sys.argv[3]):  # die between the records and _SUCCESS
                os.kill(os.getpid(), signal.SIGKILL)
        super()._put_bytes(key, data)

writer = TrafficWriter(CaptureSettings(enabled=True, batch_records=20, queue_records=100, flush_interval_s=0.05,
                                       retention_days=0), Store(sys.argv[1], fsync=False))
accepted = 0
for i in range(600):
    accepted += writer.submit(TrafficRecord.new(endpoint="/v1/completions", prompt=f"p{i}", sampling={"seq": i},
                                                response_text="r" * (i % 97)))
    time.sleep(0.0005)
print("accepted", accepted, flush=True)
time.sleep(60)
"""


def run_child(root: Path, delay: float, die_at_batch: int) -> tuple[int, int]:
    """Run a writer in a child process; kill -9 it once it has submitted everything (or it kills itself
    mid-publish). Returns (records the child accepted or -1 when it died first, exit status)."""
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(root), str(delay), str(die_at_batch)],
                            stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    if line.startswith("accepted"):
        os.kill(proc.pid, signal.SIGKILL)
    proc.wait(30)
    return (int(line.split()[1]) if line else -1), proc.returncode


def check_intact(root: Path) -> list[TrafficRecord]:
    records = TrafficLog(str(root)).records()
    seqs = [r.sampling["seq"] for r in records]
    assert len(seqs) == len(set(seqs))
    for r in records:
        assert r.prompt == f"p{r.sampling['seq']}" and r.response_text == "r" * (r.sampling["seq"] % 97)
    return records


def test_kill9_mid_traffic_loses_at_most_the_unflushed_records(tmp_path):
    accepted, status = run_child(tmp_path, 0.01, die_at_batch=10**6)
    assert status == -signal.SIGKILL and accepted > 0
    records = check_intact(tmp_path)
    assert 0 < len(records) <= accepted
    assert accepted - len(records) <= 20 + 100, "lost more than one batch plus the queue"


def test_kill9_between_records_and_success_leaves_no_visible_batch(tmp_path):
    accepted, status = run_child(tmp_path, 0.0, die_at_batch=3)
    assert status == -signal.SIGKILL and accepted == -1
    dirs = [p.parent for p in tmp_path.rglob("records.jsonl")]
    assert len(dirs) == 3 and sum((d / "_SUCCESS").exists() for d in dirs) == 2
    log = TrafficLog(str(tmp_path))
    batches, records = log.batches(), check_intact(tmp_path)
    assert len(batches) == 2 and len(records) == sum(b.records for b in batches)
    (hidden,) = [d for d in dirs if not (d / "_SUCCESS").exists()]
    hidden_seqs = {json.loads(line)["sampling"]["seq"] for line in (hidden / "records.jsonl").read_text().splitlines()}
    assert hidden_seqs and not hidden_seqs & {r.sampling["seq"] for r in records}
    # retention takes the published batches once old enough; the leftover a day later than its own age
    assert log.apply_retention(1, now=datetime.now(timezone.utc) + timedelta(days=1, hours=1)) == 2
    assert log.apply_retention(1, now=datetime.now(timezone.utc) + timedelta(days=2, hours=1)) == 1
    assert not list(tmp_path.rglob("records.jsonl"))


# -- retention -------------------------------------------------------------------------------
def test_retention_deletes_only_batches_older_than_n_days(tmp_path):
    now = datetime(2026, 3, 20, tzinfo=timezone.utc)
    ages = [10, 8, 6, 1]
    for i, days in enumerate(ages):
        write(LocalStore(tmp_path), [record(i, now - timedelta(days=days))])
    log = TrafficLog(str(tmp_path))
    assert log.apply_retention(0, now=now) == 0
    assert log.apply_retention(7, now=now) == 2
    assert [r.sampling["seq"] for r in log.records()] == [2, 3]
    assert not (tmp_path / f"{now - timedelta(days=10):%Y-%m-%d}").exists()


def test_writer_applies_retention_after_a_flush(tmp_path):
    old = datetime.now(timezone.utc) - timedelta(days=40)
    write(LocalStore(tmp_path), [record(0, old)])
    write(LocalStore(tmp_path), [record(1)], retention_days=30)
    assert [r.sampling["seq"] for r in TrafficLog(str(tmp_path)).records()] == [1]


def test_writer_needs_a_uri():
    with pytest.raises(Exception, match="PEAGLE_CAPTURE_URI"):
        TrafficWriter(CaptureSettings(enabled=True))
