"""The local rollout backend (``peagle rollout local``): the order of its steps on the two servers and the router.

The servers here are stand-ins for :class:`peagle.traffic.serve.ServerProcess` (a factory the backend
takes): they record when they start and stop, on which port, with which draft and which capture
settings, and what the router's weights were at that moment. The real servers run in the
bench (``bench/bench_traffic.py --cycles``)."""
from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from datetime import datetime, timezone

import pytest

from peagle.commands import rollout_local as local_command
from peagle.rollout import local as L
from peagle.traffic.settings import CaptureSettings

T0 = datetime(2026, 12, 3, 15, 0, tzinfo=timezone.utc)


@dataclass(frozen=True)
class Cand:
    """What the backend reads of a ``peagle.rollout.objects.Candidate``."""

    draft: str
    fingerprint: str


CANDIDATE = Cand("/drafts/candidate", "c" * 12)
OTHER = Cand("/drafts/other", "d" * 12)


class Servers:
    """A factory of stand-in servers; ``events`` is what happened, in order."""

    def __init__(self):
        self.events: list[tuple] = []
        self.backend: L.LocalBackend | None = None

    def __call__(self, argv, env, log_path, *, start_timeout_s):
        return StandInServer(self, argv, env, log_path)

    def weights(self):
        w = self.backend.router.weights()
        return w[self.backend.stable_url], w[self.backend.canary_url]


class StandInServer:
    """Stands in for a ``ServerProcess``: records start/stop with the port, the draft, the captured fingerprint."""

    def __init__(self, servers, argv, env, log_path):
        self.servers, self.env, self.log_path = servers, env, log_path
        self.port = int(argv[argv.index("--port") + 1])
        self.draft = json.loads(argv[argv.index("--speculative-config") + 1])["model"]
        self.capture = CaptureSettings.from_env(env)

    def start(self):
        self.servers.events.append(("start", self.port, self.capture.draft_fingerprint, self.servers.weights()))
        return self

    def stop(self):
        self.servers.events.append(("stop", self.port, self.capture.draft_fingerprint, self.servers.weights()))


@pytest.fixture
def backend(tmp_path):
    servers = Servers()
    capture = CaptureSettings(uri=str(tmp_path / "traffic"), flush_interval_s=2.0, redact=[])
    b = L.LocalBackend("/models/target", "/drafts/stable", capture=capture, log_dir=tmp_path / "logs", port=8123,
                       canary_port=8124, stable_fingerprint="s" * 12, k=2, server=servers, clock=lambda: T0,
                       say=lambda line: None)
    servers.backend = b
    b.servers = servers
    return b


def test_promotion_restarts_the_stable_on_its_port_only_while_it_has_no_traffic(backend):
    ev = backend.servers.events
    backend.start()
    assert ev == [("start", 8123, "s" * 12, (100, 0))]
    assert backend.stable_fingerprint() == "s" * 12 and backend.canary_fingerprint() is None
    assert backend.canary_started_at() is None and not backend.canary_serving.is_set()

    backend.deploy_canary(CANDIDATE, 10)
    assert ev[1] == ("start", 8124, CANDIDATE.fingerprint, (100, 0))  # serves before it gets any traffic
    assert backend.servers.weights() == (90, 10) and backend.canary_started_at() == T0
    assert backend.canary_fingerprint() == CANDIDATE.fingerprint and backend.canary_serving.is_set()
    backend.deploy_canary(CANDIDATE, 10)  # idempotent: no second server
    assert len(ev) == 2

    # the controller's promotion: all traffic to the canary, the stable restarted, the canary removed
    backend.set_weight(CANDIDATE, 100)
    backend.update_stable(CANDIDATE)
    assert ev[2:] == [("stop", 8123, "s" * 12, (0, 100)), ("start", 8123, CANDIDATE.fingerprint, (0, 100))]
    assert backend.stable_fingerprint() == CANDIDATE.fingerprint and backend.stable_draft == CANDIDATE.draft
    backend.update_stable(CANDIDATE)  # idempotent: it serves the candidate already
    assert len(ev) == 4
    backend.remove_canary()
    assert ev[4] == ("stop", 8124, CANDIDATE.fingerprint, (100, 0))  # the stable has the traffic back first
    assert backend.canary_fingerprint() is None and backend.canary_started_at() is None
    assert backend.stable_url == "http://127.0.0.1:8123"  # the stable endpoint never moved

    backend.close()
    assert ev[5] == ("stop", 8123, CANDIDATE.fingerprint, (100, 0))


@pytest.mark.parametrize("refused", [False, True])
def test_with_the_swap_promotion_swaps_the_stable_in_place_and_restarts_only_when_refused(tmp_path, refused):
    from peagle.traffic.swap import SwapFailed

    class Recording(Servers):
        made: list = []

        def __call__(self, argv, env, log_path, *, start_timeout_s):
            self.made.append((argv, env))
            return super().__call__(argv, env, log_path, start_timeout_s=start_timeout_s)

    servers, asked = Recording(), []

    def swapper(url, token, uri, fingerprint):
        asked.append((url, uri, fingerprint, servers.weights()))
        if refused:
            raise SwapFailed("409: not the running draft's kind of draft", "s" * 12)
        return {"fingerprint": fingerprint, "previous": "s" * 12, "seconds": 1.5}

    b = L.LocalBackend("/models/target", "/drafts/stable", capture=CaptureSettings(uri=str(tmp_path / "t")),
                       log_dir=tmp_path / "logs", port=8123, canary_port=8124, stable_fingerprint="s" * 12, k=2,
                       server=servers, clock=lambda: T0, say=lambda line: None, swap=True, swapper=swapper)
    servers.backend = b
    b.start()
    stable = servers.events[0]
    assert b.swaps_in_place  # the controller swaps without sending all traffic to the canary first
    b.deploy_canary(CANDIDATE, 50)
    b.update_stable(CANDIDATE)
    assert asked == [("http://127.0.0.1:8123", CANDIDATE.draft, CANDIDATE.fingerprint, (50, 50))]
    assert b.stable_fingerprint() == CANDIDATE.fingerprint and b.stable_draft == CANDIDATE.draft
    restarted = [e for e in servers.events if e[1] == 8123][1:]
    assert (b.swaps, restarted) == ((0, [("stop", 8123, "s" * 12, (0, 100)), ("start", 8123, CANDIDATE.fingerprint,
                                                                                 (0, 100))]) if refused else (1, []))
    assert stable == ("start", 8123, "s" * 12, (100, 0))
    # every server has the session's token, in its environment only
    token = b._swap_token
    assert len(token) >= 32 and servers.made
    assert all(env["PEAGLE_SWAP_TOKEN"] == token and token not in " ".join(argv) for argv, env in servers.made)


def test_rollback_never_touches_the_stable(backend):
    backend.start()
    backend.deploy_canary(OTHER, 50)
    backend.deploy_canary(CANDIDATE, 50)  # another draft's canary is replaced
    backend.remove_canary()
    backend.remove_canary()  # nothing left: nothing to do
    ports = [(e[0], e[1], e[2]) for e in backend.servers.events]
    assert ports == [("start", 8123, "s" * 12), ("start", 8124, OTHER.fingerprint), ("stop", 8124, OTHER.fingerprint),
                     ("start", 8124, CANDIDATE.fingerprint), ("stop", 8124, CANDIDATE.fingerprint)]
    assert backend.stable_fingerprint() == "s" * 12 and backend.servers.weights() == (100, 0)


def test_both_servers_capture_into_one_log_with_their_own_draft(backend):
    backend.start()
    backend.deploy_canary(CANDIDATE, 10)
    stable, canary = backend._stable, backend._canary
    for server, draft, fp in ((stable, "/drafts/stable", "s" * 12), (canary, CANDIDATE.draft, CANDIDATE.fingerprint)):
        assert server.capture.enabled and server.capture.uri == backend.capture.uri
        assert server.capture.draft_dir == draft and server.capture.draft_fingerprint == fp
        assert server.capture.target_dir == "/models/target" and server.capture.flush_interval_s == 2.0
        assert server.draft == draft
    assert stable.log_path.parent == canary.log_path.parent and stable.log_path != canary.log_path


def test_the_stable_is_not_restarted_while_it_has_traffic(backend):
    backend.start()
    with pytest.raises(L.LocalRolloutError, match="still has 100% of the traffic"):
        backend.update_stable(CANDIDATE)  # no canary at all
    backend.deploy_canary(CANDIDATE, 10)
    with pytest.raises(L.LocalRolloutError, match="still has 90% of the traffic"):
        backend.update_stable(CANDIDATE)
    with pytest.raises(L.LocalRolloutError, match="no canary of draft"):
        backend.set_weight(OTHER, 100)
    assert [e[0] for e in backend.servers.events] == ["start", "start"]  # nothing stopped


def test_the_stable_stops_only_once_its_requests_in_flight_are_answered(backend):
    backend.start()
    backend.deploy_canary(CANDIDATE, 1)
    backend.set_weight(CANDIDATE, 0)  # the next request goes to the stable
    answered = threading.Event()

    def request():
        with backend.router.route() as url:
            assert url == backend.stable_url
            answered.wait(10)

    client = threading.Thread(target=request)
    client.start()
    while backend.router.in_flight(backend.stable_url) == 0:
        time.sleep(0.01)
    backend.set_weight(CANDIDATE, 100)
    updating = threading.Thread(target=backend.update_stable, args=(CANDIDATE,))
    updating.start()
    time.sleep(0.2)
    assert [e[0] for e in backend.servers.events] == ["start", "start"]  # still draining
    answered.set()
    updating.join(10)
    client.join(10)
    assert [e[:3] for e in backend.servers.events[2:]] == [("stop", 8123, "s" * 12),
                                                         ("start", 8123, CANDIDATE.fingerprint)]


def test_a_drain_that_does_not_end_is_an_error(backend):
    backend.drain_timeout_s = 0.05
    backend.start()
    backend.deploy_canary(CANDIDATE, 100)
    with backend.router.route():  # a request the canary never answers
        with pytest.raises(L.LocalRolloutError, match="still answers 1 request"):
            backend.remove_canary()


def test_the_canary_needs_its_own_port_and_a_traffic_log(tmp_path):
    with pytest.raises(L.C.ConfigError, match="port of its own"):
        L.LocalBackend("t", "s", capture=CaptureSettings(uri=str(tmp_path)), log_dir=tmp_path, port=9000,
                       canary_port=9000, stable_fingerprint="s")
    with pytest.raises(L.C.ConfigError, match="traffic log"):
        L.LocalBackend("t", "s", capture=CaptureSettings(), log_dir=tmp_path, port=9000, stable_fingerprint="s")


def test_rollout_local_flags_become_settings(tmp_path):
    ns = local_command.build_parser().parse_args([
        "--target", "t", "--stable-draft", "s", "--candidate-draft", "c", "--traffic", str(tmp_path / "log"),
        "--prompts", "humaneval", "--canary-percent", "50", "--min-requests", "24", "--max-num-seqs", "4",
        "--set", "rollout.poll_s=5", "--set", "capture.flush_interval_s=2"])
    cfg = local_command.load_config(ns)
    assert cfg.capture.enabled and cfg.capture.uri == str(tmp_path / "log") and cfg.capture.flush_interval_s == 2
    assert cfg.rollout.canary_percent == 50 and cfg.rollout.min_requests == 24 and cfg.rollout.poll_s == 5
    assert cfg.engine.max_num_seqs == 4
    help_text = " ".join(local_command.build_parser().format_help().split())
    assert "stands in for the cluster's router" in help_text and "same port" in help_text


def test_rollout_local_refuses_bad_input(tmp_path, capsys):
    args = ["--target", str(tmp_path), "--stable-draft", str(tmp_path / "none"), "--candidate-draft",
            str(tmp_path / "none2"), "--traffic", str(tmp_path / "log"), "--prompts", "humaneval"]
    assert local_command.main(args) == 2
    assert "peagle: error:" in capsys.readouterr().err


@pytest.fixture(scope="module")
def published(qwen3_target, tmp_path_factory):
    """{"target", "stable", "candidate": published drafts of the tiny target, "prompts": a .jsonl}."""
    from peagle.config import DraftSettings
    from peagle.model import init_draft, save_draft

    work = tmp_path_factory.mktemp("published")
    paths = {role: str(save_draft(init_draft(str(qwen3_target), DraftSettings(num_layers=1, num_depths=2,
                                                                             init_seed=seed)), work / role))
             for role, seed in (("stable", 0), ("candidate", 1))}
    (work / "prompts.jsonl").write_text(json.dumps({"id": "p0", "messages": [{"role": "user", "content": "hi"}]}))
    return {**paths, "target": str(qwen3_target), "prompts": str(work / "prompts.jsonl")}


@pytest.fixture
def never_started(monkeypatch):
    """The calls that would have made a LocalBackend (and so started its servers): must stay empty."""
    made = []

    def refuse(*args, **kwargs):
        made.append(args)
        raise L.LocalRolloutError("a server would start here")

    monkeypatch.setattr(local_command, "LocalBackend", refuse)
    return made


def local_args(published, tmp_path, *extra):
    return ["--target", published["target"], "--stable-draft", published["stable"], "--candidate-draft",
            published["candidate"], "--traffic", str(tmp_path / "log"), "--prompts", published["prompts"], *extra]


def gate_of(directory, draft: str, passed: bool) -> str:
    """A gate.json of ``draft`` as ``peagle gate`` writes it (one check, no figures)."""
    from peagle.model.adapter import Draft
    from peagle.gate.report import GateCheck, GateResult, write_gate

    result = GateResult(passed, (GateCheck("traffic_gain", passed, 0.3 if passed else -0.2, 0.0, "AL"),),
                        {"path": "/models/target", "fingerprint": "f" * 64}, {"path": "/s", "sha256": "0" * 64},
                        {"path": draft, "sha256": Draft.open(draft).fingerprint, "trained_depths": 2}, 2, {}, {},
                        None, {})
    return str(write_gate(result, directory)[0])


@pytest.mark.parametrize("gated, passed, message", [("stable", True, "is the gate of draft"),
                                                    ("candidate", False, "the gate did not pass the candidate")])
def test_rollout_local_refuses_a_failed_gate_or_another_drafts_gate_before_serving(
        published, tmp_path, capsys, never_started, gated, passed, message):
    gate = gate_of(tmp_path / "gate", published[gated], passed)
    assert local_command.main(local_args(published, tmp_path, "--gate", gate)) == 2
    err = capsys.readouterr().err
    assert f"peagle: error: --gate: {gate}" in err and message in err, err
    assert never_started == []


def test_rollout_local_records_the_verified_gate(published, tmp_path):
    gate = gate_of(tmp_path / "gate", published["candidate"], True)
    candidate = L.candidate_of(published["candidate"], gate)
    assert candidate.gate.model_dump() == {"passed": True, "reasons": [], "report": gate}
    assert L.candidate_of(published["candidate"]).gate is None


@pytest.mark.parametrize("flags, flag", [
    (["--concurrency", "0"], "--concurrency"), (["--rounds", "-1"], "--rounds"), (["--max-tokens", "0"], "--max-tokens"),
    (["--limit", "0"], "--limit"), (["-k", "0"], "--num-speculative-tokens"), (["--port", "99999"], "--port"),
    (["--port", "0"], "--port"), (["--canary-port", "70000"], "--canary-port"),
    (["--port", "8123", "--canary-port", "8123"], "--canary-port"),
])
def test_rollout_local_bad_numbers_exit_2_naming_the_flag_before_anything_starts(
        published, tmp_path, capsys, never_started, flags, flag):
    assert local_command.main(local_args(published, tmp_path, *flags)) == 2
    assert capsys.readouterr().err.startswith(f"peagle: error: {flag}: ")
    assert never_started == []


# ---- the whole local loop: controller, router, replay, capture (stand-in servers) ---------------------

class CapturingStandIn:
    """Stands in for a vLLM server started by ``ServerProcess``: an in-process HTTP server on the argv's port
    that answers chat requests like ``peagle serve`` and captures each one into the traffic log of its
    ``PEAGLE_CAPTURE_*`` environment (the real writer), with the acceptance histogram its draft gets."""

    histograms: dict[str, list[int]] = {}  # draft fingerprint -> histogram of every answer
    started: list[tuple[int, str]] = []

    def __init__(self, argv, env, log_path, *, start_timeout_s):
        self.port = int(argv[argv.index("--port") + 1])
        self.capture = CaptureSettings.from_env(env)

    def start(self):
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        from peagle.records.traffic import TrafficRecord
        from peagle.traffic.log import TrafficWriter

        writer = self.writer = TrafficWriter(self.capture)
        hist, fp = self.histograms[self.capture.draft_fingerprint], self.capture.draft_fingerprint

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                self._send({"data": [{"id": L.SERVED_MODEL_NAME}]})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                steps = sum(hist)
                spec = {"acceptance_histogram": hist, "num_spec_tokens": len(hist) - 1,
                        "num_draft_tokens": steps * (len(hist) - 1),
                        "mean_acceptance_length": 1 + sum(i * n for i, n in enumerate(hist)) / steps}
                writer.submit(TrafficRecord.new(endpoint="/v1/chat/completions", model=body["model"],
                                                messages=body["messages"], response_text="ok", spec_decode=spec,
                                                draft_fingerprint=fp, timing={"latency_s": 0.01,
                                                                              "first_byte_s": None}))
                self._send({"choices": [{"message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
                            "metrics": {"speculative_decoding": spec}})

            def _send(self, obj):
                data = json.dumps(obj).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.http = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        threading.Thread(target=self.http.serve_forever, daemon=True).start()
        self.started.append((self.port, fp))
        return self

    def stop(self):
        self.http.shutdown()
        self.http.server_close()
        self.writer.close(10)


@pytest.mark.parametrize("candidate_hist, expected", [([2, 3, 5], "promote"), ([8, 2, 0], "rollback")])
def test_the_local_loop_decides_on_the_live_records_and_the_stable_endpoint_always_answers(
        tmp_path, candidate_hist, expected):
    from peagle.evaluate.prompts import Prompt
    from peagle.records.history import LoopHistory
    from peagle.rollout.objects import Candidate
    from peagle.rollout.settings import RolloutSettings
    from peagle.traffic.log import TrafficLog
    from peagle.traffic.serve import free_port

    stable_fp, candidate = "a" * 12, Candidate("/drafts/candidate", "c" * 12, values={})
    CapturingStandIn.histograms = {stable_fp: [5, 3, 2], candidate.fingerprint: candidate_hist}
    CapturingStandIn.started = []
    traffic = str(tmp_path / "traffic")
    capture = CaptureSettings(uri=traffic, flush_interval_s=0.2, redact=[])
    backend = L.LocalBackend("/models/target", "/drafts/stable", capture=capture, log_dir=tmp_path / "logs",
                             port=free_port(), stable_fingerprint=stable_fp, k=2, server=CapturingStandIn,
                             say=lambda line: None)
    settings = RolloutSettings(canary_percent=50, min_requests=8, poll_s=0.2, window_s=120, resamples=200)
    history = LoopHistory(str(tmp_path / "loop"))
    prompts = [Prompt(f"p{i}", ({"role": "user", "content": f"question {i}"},)) for i in range(40)]
    with backend:
        decision, replays = L.rollout_under_traffic(
            backend, candidate, prompts, traffic=TrafficLog(traffic), settings=settings, history=history,
            target_fingerprint="t" * 12, concurrency=4, say=lambda line: None)
        assert decision.decision == expected
        assert backend.canary_fingerprint() is None and backend.router.weights()[backend.stable_url] == 100
        assert backend.stable_fingerprint() == (candidate.fingerprint if expected == "promote" else stable_fp)
    assert backend.stable_fingerprint() is None  # closed: nothing serves
    (result,) = replays
    assert all(r.error is None for r in result.rows)  # no request failed while the split moved
    urls = {r.url for r in result.rows}
    assert urls == {backend.stable_url + "/v1", backend.canary_url + "/v1"}
    comparison = decision.comparison.to_dict()
    assert comparison["stable"]["fingerprint"] == stable_fp and comparison["stable"]["requests"] >= 8
    assert comparison["candidate"]["fingerprint"] == candidate.fingerprint
    assert comparison["candidate"]["requests"] >= 8
    assert [d["decision"] for d in history.all("decision")] == [expected]
    if expected == "promote":  # the stable restarted on its own port with the candidate; the promotion is on record
        assert CapturingStandIn.started == [(backend.port, stable_fp), (backend.canary_port, candidate.fingerprint),
                                            (backend.port, candidate.fingerprint)]
        assert len(history.all("promotion")) == 1
    else:  # the stable was never touched
        assert CapturingStandIn.started == [(backend.port, stable_fp), (backend.canary_port, candidate.fingerprint)]
        assert history.all("promotion") == []
