"""``peagle serve``: the server's command and environment (unit), and the real vLLM OpenAI server with the
capture on (``vllm``): what the client received is what the store holds, and a kill -9 of the server's
process group mid-traffic leaves only complete batches, losing at most the unflushed one."""
from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time

import pytest

from peagle.cli import main as peagle_main
from peagle.config import ConfigError
from peagle.engine.settings import EngineSettings
from peagle.traffic import serve as S
from peagle.traffic.settings import ENV_PREFIX, CaptureSettings

K = 2
BATCH = 4  # records per published batch in the vllm tests (no time-based flush: batches are exactly BATCH)


@pytest.fixture(scope="module")
def draft_dir(qwen3_target, tmp_path_factory):
    out = tmp_path_factory.mktemp("serve") / "draft"
    assert peagle_main(["draft", "init", "--target", str(qwen3_target), "--out", str(out), "--arch", "qwen3",
                        "--num-layers", "1", "--num-depths", str(K)]) == 0
    return out


def _arg(argv, flag):
    return argv[argv.index(flag) + 1]


# ---- unit: the command ------------------------------------------------------------------------------

def test_server_command_without_capture(qwen3_target, draft_dir):
    argv, env = S.server_command(str(qwen3_target), str(draft_dir), port=8123,
                                 engine=EngineSettings(max_num_seqs=8, max_model_len=512, cpu_kv_cache_gib=2))
    assert argv[:3] == [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
    assert _arg(argv, "--model") == str(qwen3_target) and _arg(argv, "--port") == "8123"
    spec = json.loads(_arg(argv, "--speculative-config"))
    # K defaults to the depths the draft was trained for
    assert spec == {"method": "eagle3", "model": str(draft_dir), "num_speculative_tokens": K,
                    "parallel_drafting": True}
    assert _arg(argv, "--per-request-spec-decode-metrics") == "summary"
    assert _arg(argv, "--max-num-seqs") == "8" and _arg(argv, "--max-model-len") == "512"
    assert "--enforce-eager" in argv and "--no-trust-remote-code" in argv  # the offline stages' defaults
    assert "--middleware" not in argv and "--enable-force-include-usage" not in argv
    assert not any(k.startswith(ENV_PREFIX) for k in env)
    assert env[S.KV_CACHE_ENV] == os.environ.get(S.KV_CACHE_ENV, "2")  # one set in the environment wins
    assert env["HF_HUB_OFFLINE"] == "1" and "src" in env["PYTHONPATH"]


def test_server_command_with_capture_sets_exactly_the_capture_settings(qwen3_target, draft_dir):
    capture = CaptureSettings(enabled=True, uri="s3://bucket/traffic", sample_rate=0.5, redact=["email"])
    argv, env = S.server_command(str(qwen3_target), str(draft_dir), k=3, capture=capture)
    assert _arg(argv, "--middleware") == "peagle.traffic.middleware.CaptureMiddleware"
    assert "--enable-force-include-usage" in argv
    assert json.loads(_arg(argv, "--speculative-config"))["num_speculative_tokens"] == 3
    # one variable per field, no more, no less (the chart sets the same ones)
    assert {k for k in env if k.startswith(ENV_PREFIX)} == {ENV_PREFIX + f.upper()
                                                            for f in CaptureSettings.model_fields}
    back = CaptureSettings.from_env(env)
    assert back == capture.model_copy(update={"target_dir": str(qwen3_target), "draft_dir": str(draft_dir)})


@pytest.mark.parametrize("kwargs, match", [
    ({"capture": CaptureSettings(enabled=True)}, "no uri"),
    ({"engine": EngineSettings(in_process=True)}, "not to a server"),
    ({"k": 0}, ">= 1"),
])
def test_server_command_refuses(qwen3_target, draft_dir, kwargs, match):
    with pytest.raises(ConfigError, match=match):
        S.server_command(str(qwen3_target), str(draft_dir), **kwargs)


def test_serve_flags_become_settings():
    ns = S.build_parser().parse_args(["--target", "t", "--draft", "d", "--capture", "/tmp/log",
                                      "--capture-sample-rate", "0.25", "--capture-redact", "email", "re:x+",
                                      "--max-num-seqs", "4", "--set", "capture.batch_records=7"])
    cfg = S.load_config(ns)
    assert cfg.capture.enabled and cfg.capture.uri == "/tmp/log" and cfg.capture.sample_rate == 0.25
    assert cfg.capture.redact == ["email", "re:x+"] and cfg.capture.batch_records == 7
    assert cfg.engine.max_num_seqs == 4
    assert not S.load_config(S.build_parser().parse_args(["--target", "t", "--draft", "d"])).capture.enabled


def test_serve_bad_draft_exits_2(tmp_path, capsys):
    assert S.main(["--target", str(tmp_path), "--draft", str(tmp_path / "none")]) == 2
    assert "peagle: error:" in capsys.readouterr().err


def test_server_process_reports_the_log_tail(tmp_path):
    dies = [sys.executable, "-c", "print('engine exploded'); raise SystemExit(3)", "--host", "127.0.0.1",
            "--port", str(S.free_port())]
    with pytest.raises(S.ServeError, match="exited with 3(.|\n)*engine exploded"):
        S.ServerProcess(dies, {}, tmp_path / "dies.log").start()
    hangs = [sys.executable, "-c", "import time; print('loading'); time.sleep(60)", "--host", "127.0.0.1",
             "--port", str(S.free_port())]
    t0 = time.monotonic()
    with pytest.raises(S.ServeError, match="not healthy(.|\n)*after 2 s(.|\n)*loading"):
        S.ServerProcess(hangs, {}, tmp_path / "hangs.log", start_timeout_s=2).start()
    assert time.monotonic() - t0 < 30  # and the hanging process group was killed, not waited for


# ---- vllm: the real server with capture ---------------------------------------------------------------

@pytest.fixture(scope="module")
def served(qwen3_target, draft_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("served")
    capture = CaptureSettings(enabled=True, uri=str(root / "traffic"), batch_records=BATCH, flush_interval_s=3600,
                              redact=[])
    argv, env = S.server_command(str(qwen3_target), str(draft_dir), port=S.free_port(), served_model_name="tiny",
                                 engine=EngineSettings(max_model_len=512, max_num_seqs=4), capture=capture)
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


def _prompts(tag, n):
    from peagle.evaluate.prompts import Prompt

    return [Prompt(f"{tag}{i}", ({"role": "user", "content": f"{tag} question {i}: write a loop"},)) for i in range(n)]


@pytest.mark.vllm
def test_captured_records_hold_what_the_client_received(served, qwen3_target, draft_dir):
    from peagle.evaluate.report import draft_fingerprint
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
        assert rec.draft_fingerprint == draft_fingerprint(draft_dir)
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


def test_a_bad_redaction_pattern_stops_serve_before_anything_starts(tmp_path, capsys, monkeypatch):
    """Compiled where the settings are built: exit 2 in one line naming the setting, no server started."""
    from peagle.traffic import serve

    monkeypatch.setattr(serve.subprocess, "Popen", lambda *a, **k: pytest.fail("a server was started"))
    rc = serve.main(["--target", str(tmp_path / "t"), "--draft", str(tmp_path / "d"), "--capture",
                     str(tmp_path / "log"), "--capture-redact", "re:("])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "capture.redact" in err[0] and "re:(" in err[0], err



# -- the server's lifetime: a real process tree, a stand-in server (the subject is the supervision) ---------
STAND_IN_SERVER = """
import os, signal, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])  # as vLLM's engine core
with open(sys.argv[1] + ".tmp", "w") as fh:
    fh.write(f"{os.getpid()} {child.pid}")
os.rename(sys.argv[1] + ".tmp", sys.argv[1])
time.sleep(600)
"""
SUPERVISOR = """
import sys
from peagle.traffic.serve import supervise
sys.exit(supervise([sys.executable, "-c", sys.argv[1], sys.argv[2]], None, grace_s=5))
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie is gone
    except FileNotFoundError:
        return False


def _server_pids(path, timeout: float = 30.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, "the stand-in server did not start"
        time.sleep(0.05)
    return [int(p) for p in path.read_text().split()]


def _gone(pids: list[int], timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not any(_alive(p) for p in pids)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_a_stop_signal_to_serve_stops_its_whole_server(tmp_path, sig):
    import subprocess

    pids_file = tmp_path / "pids"
    sup = subprocess.Popen([sys.executable, "-c", SUPERVISOR, STAND_IN_SERVER, str(pids_file)])
    try:
        pids = _server_pids(pids_file)
        sup.send_signal(sig)
        assert sup.wait(timeout=30) == 128 + sig
        assert _gone(pids), [p for p in pids if _alive(p)]
    finally:
        sup.kill()


def test_serve_and_its_server_stop_when_its_parent_dies(tmp_path):
    import subprocess

    pids_file, sup_file = tmp_path / "pids", tmp_path / "sup"
    shell = subprocess.Popen(["sh", "-c", f'"$0" -c "$1" "$2" "$3" & echo $! > {sup_file}; wait',
                              sys.executable, SUPERVISOR, STAND_IN_SERVER, str(pids_file)])
    try:
        pids = _server_pids(pids_file)
        supervisor = int(sup_file.read_text())
        shell.kill()  # SIGKILL: nothing of the shell's runs; the kernel tells its child
        shell.wait()
        assert _gone([supervisor, *pids]), [p for p in [supervisor, *pids] if _alive(p)]
    finally:
        shell.kill()


def test_the_server_stops_when_serve_is_killed(tmp_path):
    import subprocess

    pids_file = tmp_path / "pids"
    sup = subprocess.Popen([sys.executable, "-c", SUPERVISOR, STAND_IN_SERVER, str(pids_file)])
    pids = _server_pids(pids_file)
    sup.kill()  # SIGKILL: no handler runs; the server gets SIGTERM from the kernel
    sup.wait()
    assert _gone(pids[:1])
    try:  # the stand-in has no SIGTERM handler to stop its own child (vLLM's server does)
        os.kill(pids[1], signal.SIGKILL)
    except ProcessLookupError:
        pass
