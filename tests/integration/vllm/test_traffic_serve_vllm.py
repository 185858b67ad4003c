"""``peagle serve``'s real vLLM OpenAI server with the capture on: what the client received is what the
store holds, and a kill -9 of the server's process group mid-traffic leaves only complete batches, losing at
most the unflushed one. (The command, flags and supervisor without vLLM: tests/unit/traffic/test_traffic_serve.py.)"""
from __future__ import annotations

import signal
import threading
import time

import pytest

from peagle.engine.settings import EngineSettings
from peagle.traffic import serve as S
from peagle.traffic.settings import CaptureSettings
from support.traffic_prompts import serve_prompts as _prompts

K = 2  # the ladder draft's depths
BATCH = 4  # records per published batch (no time-based flush: batches are exactly BATCH)


@pytest.fixture(scope="module")
def served(qwen3_target, ladder_init_draft, tmp_path_factory):
    root = tmp_path_factory.mktemp("served")
    capture = CaptureSettings(enabled=True, uri=str(root / "traffic"), batch_records=BATCH, flush_interval_s=3600,
                              redact=[])
    argv, env = S.server_command(str(qwen3_target), str(ladder_init_draft), port=S.free_port(),
                                 served_model_name="tiny", engine=EngineSettings(max_model_len=512, max_num_seqs=4),
                                 capture=capture)
    with S.ServerProcess(argv, env, root / "server.log", start_timeout_s=600) as server:
        yield server, capture.uri


def _stored(uri):
    from peagle.traffic.log import TrafficLog

    return TrafficLog(uri).records()


def _wait_for(uri, n, timeout=60):
    deadline = time.monotonic() + timeout
    while len(records := _stored(uri)) < n and time.monotonic() < deadline:
        time.sleep(0.5)
    return records


@pytest.mark.vllm
def test_captured_records_hold_what_the_client_received(served, qwen3_target, ladder_init_draft):
    from peagle.records.identity import identify_draft
    from peagle.model.target import fingerprint
    from peagle.traffic.replay import replay

    server, uri = served
    sent = {}
    for stream in (False, True):  # BATCH requests each: two full batches
        res = replay(server.url, _prompts("stream" if stream else "json", BATCH), concurrency=2, max_tokens=12,
                     stream=stream, progress=None)
        assert all(r.error is None and r.histogram and len(r.histogram) == K + 1 for r in res.rows), res.rows
        sent.update({(stream, p.messages[0]["content"]): r for p, r in zip(_prompts("stream" if stream else "json",
                                                                                    BATCH), res.rows)})
    records = _wait_for(uri, 2 * BATCH)
    assert len(records) == 2 * BATCH
    for rec in records:
        row = sent[(rec.stream, rec.messages[-1]["content"])]
        assert rec.endpoint == "/v1/chat/completions" and rec.model == "tiny" and rec.status == 200
        assert rec.response_text == row.text and rec.finish_reason == row.finish_reason
        assert rec.spec_decode["acceptance_histogram"] == row.histogram
        assert rec.spec_decode["num_spec_tokens"] == K
        assert rec.usage["completion_tokens"] == row.completion_tokens
        assert rec.sampling["max_tokens"] == 12 and rec.temperature == 0.0
        assert rec.target_fingerprint == fingerprint(qwen3_target)
        assert rec.draft_fingerprint == identify_draft(ladder_init_draft).fingerprint
        assert rec.timing["latency_s"] > 0


@pytest.mark.vllm
def test_kill_9_mid_traffic_keeps_complete_batches_and_loses_at_most_the_unflushed_one(served):
    from peagle.traffic.log import TrafficLog
    from peagle.traffic.replay import replay

    server, uri = served
    before = len(_stored(uri))
    results = []
    traffic = threading.Thread(target=lambda: results.append(
        replay(server.url, _prompts("kill", 40), concurrency=2, max_tokens=16, retries=0, timeout=60,
               progress=None)), daemon=True)
    traffic.start()
    _wait_for(uri, before + 2 * BATCH, timeout=300)  # mid-traffic: two more batches published, more in flight
    server.kill(signal.SIGKILL)
    traffic.join(timeout=120)
    (res,) = results
    answered = sum(r.error is None for r in res.rows)
    assert 0 < answered < 40, "the kill did not land mid-traffic"
    log = TrafficLog(uri)
    batches = log.batches()
    assert all(b.records == BATCH for b in batches)  # only complete batches are visible
    stored = len(log.records()) - before
    assert stored == sum(b.records for b in batches) - before
    assert 0 <= answered - stored <= BATCH, (answered, stored)  # lost at most the unflushed batch
