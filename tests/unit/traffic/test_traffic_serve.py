"""``peagle serve``: the server's command and environment, its flags, and its supervisor (with a stand-in
server's real process tree). The real vLLM OpenAI server with the capture on:
tests/integration/vllm/test_traffic_serve_vllm.py."""
from __future__ import annotations

import json
import os
import signal
import sys
import time

import pytest

from peagle.config import ConfigError
from peagle.engine.settings import EngineSettings
from peagle.commands import serve as serve_command
from peagle.traffic import serve as S
from peagle.traffic.settings import ENV_PREFIX, CaptureSettings

K = 2  # the depths of the ladder's drafts (support.ladder.LADDER_DRAFT)


def _arg(argv, flag):
    return argv[argv.index(flag) + 1]


# ---- unit: the command ------------------------------------------------------------------------------

def test_server_command_without_capture(qwen3_target, ladder_init_draft):
    argv, env = S.server_command(str(qwen3_target), str(ladder_init_draft), port=8123,
                                 engine=EngineSettings(max_num_seqs=8, max_model_len=512, cpu_kv_cache_gib=2))
    assert argv[:3] == [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
    assert _arg(argv, "--model") == str(qwen3_target) and _arg(argv, "--port") == "8123"
    spec = json.loads(_arg(argv, "--speculative-config"))
    # K defaults to the depths the draft was trained for
    assert spec == {"method": "eagle3", "model": str(ladder_init_draft), "num_speculative_tokens": K,
                    "parallel_drafting": True}
    assert _arg(argv, "--per-request-spec-decode-metrics") == "summary"
    assert _arg(argv, "--max-num-seqs") == "8" and _arg(argv, "--max-model-len") == "512"
    assert "--enforce-eager" in argv and "--no-trust-remote-code" in argv  # the offline stages' defaults
    assert "--middleware" not in argv and "--enable-force-include-usage" not in argv
    assert not any(k.startswith(ENV_PREFIX) for k in env)
    assert env[S.KV_CACHE_ENV] == os.environ.get(S.KV_CACHE_ENV, "2")  # one set in the environment wins
    assert env["HF_HUB_OFFLINE"] == "1" and "src" in env["PYTHONPATH"]


def test_server_command_with_capture_sets_exactly_the_capture_settings(qwen3_target, ladder_init_draft):
    capture = CaptureSettings(enabled=True, uri="s3://bucket/traffic", sample_rate=0.5, redact=["email"])
    argv, env = S.server_command(str(qwen3_target), str(ladder_init_draft), k=3, capture=capture)
    assert _arg(argv, "--middleware") == "peagle.traffic.middleware.CaptureMiddleware"
    assert "--enable-force-include-usage" in argv
    assert json.loads(_arg(argv, "--speculative-config"))["num_speculative_tokens"] == 3
    # one variable per field, no more, no less (the chart sets the same ones)
    assert {k for k in env if k.startswith(ENV_PREFIX)} == {ENV_PREFIX + f.upper()
                                                            for f in CaptureSettings.model_fields}
    back = CaptureSettings.from_env(env)
    assert back == capture.model_copy(update={"target_dir": str(qwen3_target), "draft_dir": str(ladder_init_draft)})


def test_server_command_with_the_swap_serves_its_endpoint_and_engine(qwen3_target, ladder_init_draft):
    """--swap: the middleware (capture off), the peagle-draft weight-transfer engine, the worker extension the
    endpoint asks which draft serves, and the token in the server's environment only."""
    argv, env = S.server_command(str(qwen3_target), str(ladder_init_draft), swap_token="t0ken")
    assert _arg(argv, "--middleware") == "peagle.traffic.middleware.CaptureMiddleware"
    assert json.loads(_arg(argv, "--weight-transfer-config")) == {"backend": "peagle-draft"}
    assert _arg(argv, "--worker-extension-cls") == "peagle.swap.engine.DraftSwapWorker"
    assert env["PEAGLE_SWAP_TOKEN"] == "t0ken" and "t0ken" not in " ".join(argv)
    capture = CaptureSettings(enabled=True, uri="s3://bucket/traffic")
    argv, _ = S.server_command(str(qwen3_target), str(ladder_init_draft), capture=capture, swap_token="t0ken")
    assert argv.count("--middleware") == 1


def test_serve_swap_without_its_token_stops_before_anything_starts(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(S.subprocess, "Popen", lambda *a, **k: pytest.fail("a server was started"))
    monkeypatch.delenv("PEAGLE_SWAP_TOKEN", raising=False)
    rc = serve_command.main(["--target", str(tmp_path / "t"), "--draft", str(tmp_path / "d"), "-k", "1", "--swap"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err == ["peagle: error: --swap: the swap endpoint's token comes from the environment variable "
                               "PEAGLE_SWAP_TOKEN, which is empty"], err


def test_server_command_serves_the_evaluations_schedule(qwen3_target, ladder_init_draft, tmp_path):
    from peagle.speed import ScheduleRange, SpeculationSchedule

    def sched(*ranges):
        return SpeculationSchedule(max_batch_size=8, ranges=[ScheduleRange(lo=a, hi=b, k=k) for a, b, k in ranges])

    (tmp_path / "schedule.json").write_text(sched((1, 2, 2), (3, 8, 0)).to_json())
    mixed = SpeculationSchedule.read(tmp_path)  # as `peagle serve --schedule` reads it
    argv, _ = S.server_command(str(qwen3_target), str(ladder_init_draft), schedule=mixed)
    spec = json.loads(_arg(argv, "--speculative-config"))
    assert spec["num_speculative_tokens"] == 2 and spec["num_speculative_tokens_per_batch_size"] == [[1, 2, 2], [3, 8, 0]]
    assert _arg(argv, "--per-request-spec-decode-metrics") == "summary"
    argv, _ = S.server_command(str(qwen3_target), str(ladder_init_draft), schedule=sched((1, 8, 1)))
    assert json.loads(_arg(argv, "--speculative-config")) == {
        "method": "eagle3", "model": str(ladder_init_draft), "num_speculative_tokens": 1, "parallel_drafting": True}
    argv, _ = S.server_command(str(qwen3_target), str(ladder_init_draft), schedule=sched((1, 8, 0)))
    assert "--speculative-config" not in argv and "--per-request-spec-decode-metrics" not in argv  # target alone
    with pytest.raises(ConfigError, match="disagrees with the schedule"):
        S.server_command(str(qwen3_target), str(ladder_init_draft), k=1, schedule=mixed)
    with pytest.raises(ConfigError, match=f"beyond the draft's {K} trained depths"):
        S.server_command(str(qwen3_target), str(ladder_init_draft), schedule=sched((1, 8, K + 1)))


@pytest.mark.parametrize("kwargs, match", [
    ({"capture": CaptureSettings(enabled=True)}, "no uri"),
    ({"engine": EngineSettings(in_process=True)}, "not to a server"),
    ({"k": 0}, ">= 1"),
])
def test_server_command_refuses(qwen3_target, ladder_init_draft, kwargs, match):
    with pytest.raises(ConfigError, match=match):
        S.server_command(str(qwen3_target), str(ladder_init_draft), **kwargs)


def test_serve_flags_become_settings():
    ns = serve_command.build_parser().parse_args(["--target", "t", "--draft", "d", "--capture", "/tmp/log",
                                                  "--capture-sample-rate", "0.25", "--capture-redact", "email",
                                                  "re:x+", "--max-num-seqs", "4", "--set", "capture.batch_records=7"])
    cfg = serve_command.load_config(ns)
    assert cfg.capture.enabled and cfg.capture.uri == "/tmp/log" and cfg.capture.sample_rate == 0.25
    assert cfg.capture.redact == ["email", "re:x+"] and cfg.capture.batch_records == 7
    assert cfg.engine.max_num_seqs == 4
    bare = serve_command.build_parser().parse_args(["--target", "t", "--draft", "d"])
    assert not serve_command.load_config(bare).capture.enabled


def test_serve_bad_draft_exits_2(tmp_path, capsys):
    assert serve_command.main(["--target", str(tmp_path), "--draft", str(tmp_path / "none")]) == 2
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


# ---- unit: the supervisor, with a real process tree (a server stand-in and its listening worker) ------

# The server stand-in: starts a worker that listens on a port (as vLLM's engine core holds its resources),
# writes "its pid, the worker's pid, the port" to argv[1] once listening, then does END.
SERVER = """
import os, subprocess, sys, time
worker = subprocess.Popen([sys.executable, "-c", '''
import socket, time
s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen()
print(s.getsockname()[1], flush=True)
time.sleep(120)
'''], stdout=subprocess.PIPE, text=True)
port = worker.stdout.readline().strip()
with open(sys.argv[1] + ".tmp", "w") as fh:
    fh.write(f"{os.getpid()} {worker.pid} {port}")
os.replace(sys.argv[1] + ".tmp", sys.argv[1])
END
"""
SUPERVISOR = "import sys; from peagle.traffic.serve import supervise; sys.exit(supervise(sys.argv[1:], grace_s=5))"
PARENT = "import subprocess, sys, time; subprocess.Popen(sys.argv[1:]); time.sleep(120)"  # the supervisor's


def _server(end="time.sleep(120)"):
    return SERVER.replace("END", end)


def _gone(pid):
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] == "Z"  # a zombie nobody reaped yet runs nothing
    except FileNotFoundError:
        return True


def _port_free(port):
    import socket

    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


def _tree(tmp_path, *, with_parent=False):
    """The started top process (the supervisor, or its parent) and the pids and port below it, once listening."""
    import subprocess

    ready = tmp_path / "ready"
    argv = [sys.executable, "-c", SUPERVISOR, sys.executable, "-c", _server(), str(ready)]
    if with_parent:
        argv = [sys.executable, "-c", PARENT] + argv
    top = subprocess.Popen(argv, start_new_session=True)
    deadline = time.monotonic() + 30
    while not ready.exists():
        assert time.monotonic() < deadline and top.poll() is None, "the process tree did not start"
        time.sleep(0.05)
    server, worker, port = map(int, ready.read_text().split())
    return top, [server, worker], port


def _all_stopped(pids, port, timeout=10):
    deadline = time.monotonic() + timeout
    while not (all(map(_gone, pids)) and _port_free(port)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return all(map(_gone, pids)) and _port_free(port)


def _kill_all(top, pids):
    for pid in [top.pid] + pids:  # whatever a failing test left behind, with its group
        for kill in (os.killpg, os.kill):
            try:
                kill(pid, signal.SIGKILL)
            except OSError:
                pass
    top.wait()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP], ids=lambda s: s.name)
def test_a_stop_signal_to_serve_stops_the_server_and_its_workers(tmp_path, sig):
    top, pids, port = _tree(tmp_path)
    try:
        assert not _port_free(port)
        top.send_signal(sig)
        assert top.wait(timeout=15) == 128 + sig
        assert _all_stopped(pids, port)
    finally:
        _kill_all(top, pids)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("killed", ["the parent of serve", "serve"])
def test_a_kill_9_of_serve_or_its_parent_stops_the_server_and_its_workers(tmp_path, killed):
    top, pids, port = _tree(tmp_path, with_parent=killed == "the parent of serve")
    try:
        top.kill()  # SIGKILL: no handler runs in the killed process
        top.wait()
        assert _all_stopped(pids, port)
    finally:
        _kill_all(top, pids)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_server_that_exits_by_itself_gives_its_status_and_leaves_no_worker(tmp_path):
    ready = tmp_path / "ready"
    assert S.supervise([sys.executable, "-c", _server("raise SystemExit(3)"), str(ready)], grace_s=5) == 3
    server, worker, port = map(int, ready.read_text().split())
    assert _all_stopped([server, worker], port)


def test_a_bad_redaction_pattern_stops_serve_before_anything_starts(tmp_path, capsys, monkeypatch):
    """Compiled where the settings are built: exit 2 in one line naming the setting, no server started.
    (``-k``: nothing else reads the draft before the server would start.)"""
    from peagle.traffic import serve

    monkeypatch.setattr(serve.subprocess, "Popen", lambda *a, **k: pytest.fail("a server was started"))
    rc = serve_command.main(["--target", str(tmp_path / "t"), "--draft", str(tmp_path / "d"), "--capture",
                             str(tmp_path / "log"), "--capture-redact", "re:(", "-k", "1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "capture.redact" in err[0] and "re:(" in err[0], err


@pytest.mark.parametrize("flags, named", [
    (["--port", "70000"], "--port"),
    (["--port", "0"], "--port"),
    (["--capture", "ftp://host/traffic"], "--capture"),
    (["--capture", "FILE"], "--capture"),  # a local traffic log that is a file
    (["--port", "BUSY"], "--port"),  # another server listens there
    (["--host", "203.0.113.7"], "--host"),  # an address of no interface here (TEST-NET-3)
])
def test_a_bad_serve_flag_stops_serve_before_anything_starts(tmp_path, capsys, monkeypatch, flags, named):
    import socket

    (tmp_path / "file").write_text("x")
    monkeypatch.setattr(S.subprocess, "Popen", lambda *a, **k: pytest.fail("a server was started"))
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        flags = [{"FILE": str(tmp_path / "file"), "BUSY": str(busy.getsockname()[1])}.get(f, f) for f in flags]
        rc = serve_command.main(["--target", str(tmp_path / "t"), "--draft", str(tmp_path / "d"), "-k", "1", *flags])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith(f"peagle: error: {named}: "), err
