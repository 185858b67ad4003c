"""The rollout loop on one machine: two real ``peagle serve`` processes and a weighted router.

    peagle rollout local --target DIR --stable-draft DIR --candidate-draft DIR --traffic LOG \\
        --prompts humaneval [--canary-percent 50] [--min-requests 24] [--concurrency 8] [--max-tokens 96] \\
        [--gate gate.json] [--port 8000] [--config run.yaml --set rollout.window_s=600 ...]

:class:`LocalBackend` is the controller's :class:`~peagle.rollout.controller.Backend` with real vLLM
servers (:class:`peagle.traffic.serve.ServerProcess`):

* the **stable** serves on a fixed port, so its URL never changes (the stable endpoint);
* the **canary** serves the candidate on a second port;
* both capture into the same traffic log, each with its own draft directory and the fingerprint the
  controller knows it by, so every record says which draft answered;
* a :class:`peagle.traffic.replay.WeightedRouter` picks the server of each request. It stands in for
  the cluster's router (a Route's ``alternateBackends`` weights, an HTTPRoute's backend weights,
  KServe's canary split); ``set_weight`` changes its weights;
* ``update_stable`` restarts the stable on the **same port** with the candidate's draft while the
  stable has weight 0 (the canary carries all traffic meanwhile, and the router drains the stable's
  requests in flight first), the local counterpart of a Deployment's Recreate behind a weighted route;
  with ``swap`` (``peagle rollout local --swap``) it swaps the stable's draft in place instead
  (:func:`peagle.traffic.swap.swap_draft`, the server confirming the candidate's fingerprint), and
  restarts only when the swap is refused;
* ``remove_canary`` gives the canary weight 0, drains it, then stops it.

``peagle rollout local`` (:mod:`peagle.commands.rollout_local`) serves the stable, replays a prompt set
through the router once the canary gets traffic, runs :func:`peagle.rollout.controller.run_rollout` on the
live records and prints the decision. Exit status: 0 promoted, 1 rolled back, 2 bad input, 3 failed.
"""
from __future__ import annotations

import secrets
import threading
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

from .. import config as C
from ..engine.settings import EngineSettings
from ..errors import PeagleError
from ..records.decision import Decision
from ..records.history import LoopHistory
from ..records.identity import identify_draft
from ..traffic.log import TrafficLog
from ..traffic.replay import ReplayResult, WeightedRouter, replay
from ..traffic.serve import ServerProcess, free_port, server_command
from ..traffic.settings import CaptureSettings
from ..traffic.swap import SwapFailed, swap_draft
from .assemble import read_gate
from .controller import run_rollout
from .objects import Candidate
from .settings import RolloutSettings

if TYPE_CHECKING:
    from ..evaluate.prompts import Prompt

SERVED_MODEL_NAME = "peagle"  # both servers answer to one model name, as behind one endpoint


class LocalRolloutError(PeagleError, RuntimeError):
    """A local server could not be started, or a step would leave the stable endpoint without a server."""

    exit_code = 3


def utc_now() -> datetime:
    return datetime.now(timezone.utc)


class LocalBackend:
    """Stable and canary ``peagle serve`` processes behind a :class:`WeightedRouter` (module docstring).

    ``stable_fingerprint``: the fingerprint the stable draft is known by, the same kind as
    ``Candidate.fingerprint`` (the records it serves carry it). ``server`` makes a server from
    ``(argv, env, log_path, start_timeout_s=...)`` (:class:`ServerProcess`; a test passes a stand-in).
    :meth:`start` serves the stable; :meth:`close` stops whatever runs; the backend is a context manager.
    """

    routing = "local"  # the weighted router stands in for the cluster's (recorded in the decision)

    def __init__(self, target: str, stable_draft: str, *, capture: CaptureSettings, log_dir: str | Path, port: int,
                 stable_fingerprint: str, k: int | None = None, canary_port: int | None = None,
                 host: str = "127.0.0.1", engine: EngineSettings | None = None,
                 start_timeout_s: float = 1800.0, drain_timeout_s: float = 600.0,
                 server: Callable[..., Any] = ServerProcess, clock: Callable[[], datetime] = utc_now,
                 say: Callable[[str], None] = print, swap: bool = False,
                 swapper: Callable[..., dict] = swap_draft):
        if not capture.uri:
            raise C.ConfigError("the local rollout needs a traffic log: capture.uri is empty")
        self.target, self.k, self.host, self.engine = str(target), k, host, engine
        self.capture = capture.model_copy(update={"enabled": True})
        self.log_dir = Path(log_dir)
        self.port, self.canary_port = int(port), int(canary_port or free_port(host))
        if self.canary_port == self.port:
            raise C.ConfigError(f"the canary needs a port of its own, not the stable's {self.port}")
        self.stable_url, self.canary_url = f"http://{host}:{self.port}", f"http://{host}:{self.canary_port}"
        self.router = WeightedRouter({self.stable_url: 100, self.canary_url: 0})
        self.start_timeout_s, self.drain_timeout_s = start_timeout_s, drain_timeout_s
        self._server, self._clock, self._say = server, clock, say
        self._stable_draft, self._stable_fp = str(stable_draft), stable_fingerprint
        self._stable = None  # its server, once started
        self._canary = None
        self._canary_fp: str | None = None
        self._canary_started_at: datetime | None = None
        self._starts = 0
        # the servers' swap token: made here, known to this process and its servers only
        self._swap_token = secrets.token_urlsafe(32) if swap else None
        self._swapper = swapper
        self.swaps = 0  # promotions done by a swap (the others restarted the stable)
        self.canary_serving = threading.Event()  # set while the canary has weight (traffic may start)

    # ---- the servers ----------------------------------------------------------------------------------

    def _serve(self, draft: str, fingerprint: str, port: int, role: str):
        self._starts += 1
        capture = self.capture.model_copy(update={"target_dir": self.target, "draft_dir": draft,
                                                  "draft_fingerprint": fingerprint})
        argv, env = server_command(self.target, draft, k=self.k, host=self.host, port=port,
                                   served_model_name=SERVED_MODEL_NAME, engine=self.engine, capture=capture,
                                   swap_token=self._swap_token)
        log = self.log_dir / f"{self._starts:02d}-{role}-{fingerprint[:12]}.log"
        self._say(f"serving draft {fingerprint} as the {role} on port {port} (log {log})")
        try:
            return self._server(argv, env, log, start_timeout_s=self.start_timeout_s).start()
        except PeagleError as exc:
            raise LocalRolloutError(f"the {role} of draft {fingerprint} did not start: {exc}") from None

    def _drain(self, url: str, role: str) -> None:
        if not self.router.drain(url, self.drain_timeout_s):
            raise LocalRolloutError(f"the {role} at {url} still answers {self.router.in_flight(url)} request(s) "
                                    f"after {self.drain_timeout_s:g} s without weight")

    def start(self) -> "LocalBackend":
        """Serve the stable draft on the stable port (all traffic goes to it)."""
        if self._stable is None:
            self._stable = self._serve(self._stable_draft, self._stable_fp, self.port, "stable")
        return self

    def close(self) -> None:
        """Stop the canary and the stable (the end of a local session, not a rollout step)."""
        for server in (self._canary, self._stable):
            if server is not None:
                server.stop()
        self._canary = self._stable = None

    def __enter__(self) -> "LocalBackend":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ---- Backend --------------------------------------------------------------------------------------

    def stable_fingerprint(self) -> str | None:
        return self._stable_fp if self._stable is not None else None

    def canary_fingerprint(self) -> str | None:
        return self._canary_fp

    def canary_started_at(self) -> datetime | None:
        return self._canary_started_at

    @property
    def swaps_in_place(self) -> bool:
        """Promotion swaps the stable's draft while it keeps its share (the controller skips sending all
        traffic to the canary first)."""
        return self._swap_token is not None

    @property
    def stable_draft(self) -> str:
        return self._stable_draft

    def deploy_canary(self, candidate: "Candidate", percent: int) -> None:
        if self._canary_fp not in (None, candidate.fingerprint):
            self.remove_canary()
        if self._canary is None:
            self._canary = self._serve(candidate.draft, candidate.fingerprint, self.canary_port, "canary")
            self._canary_fp = candidate.fingerprint
        self.set_weight(candidate, percent)

    def set_weight(self, candidate: "Candidate", percent: int) -> None:
        if self._canary_fp != candidate.fingerprint:
            raise LocalRolloutError(f"no canary of draft {candidate.fingerprint} to weight "
                                    f"(the canary serves {self._canary_fp or 'nothing'})")
        if not 0 <= percent <= 100:
            raise ValueError(f"the canary's share is 0..100, got {percent}")
        self.router.set_weights({self.stable_url: 100 - percent, self.canary_url: percent})
        if percent > 0:
            if self._canary_started_at is None:
                self._canary_started_at = self._clock()
            self.canary_serving.set()
        else:
            self.canary_serving.clear()
        self._say(f"split: stable {100 - percent}%, canary {percent}%")

    def update_stable(self, candidate: "Candidate") -> None:
        if self._stable is not None and self._stable_fp == candidate.fingerprint:
            return  # it serves the candidate already (start() returned once it was healthy)
        if self._swap_token and self._stable is not None:
            try:  # in place: no restart, no request fails, the traffic may stay where it is
                answer = self._swapper(self.stable_url, self._swap_token, candidate.draft, candidate.fingerprint)
            except SwapFailed as exc:
                self._say(f"the stable did not swap to draft {candidate.fingerprint} ({exc}); restarting it instead")
                if self._canary_fp == candidate.fingerprint:
                    self.set_weight(candidate, 100)  # the restart needs the stable without traffic
            else:
                self._stable_draft, self._stable_fp = candidate.draft, candidate.fingerprint
                self.swaps += 1
                self._say(f"the stable swapped to draft {candidate.fingerprint} in {answer.get('seconds')} s "
                          f"({answer.get('phases')}), without a restart")
                return
        weights = self.router.weights()
        if weights[self.stable_url] != 0 or self._canary_fp != candidate.fingerprint:
            # restarting it now would fail the requests the router still sends it
            raise LocalRolloutError(f"the stable still has {weights[self.stable_url]}% of the traffic (canary: "
                                    f"{self._canary_fp or 'none'}); send all of it to the candidate's canary first")
        self._drain(self.stable_url, "stable")
        if self._stable is not None:
            self._stable.stop()
            self._stable = None
        self._stable = self._serve(candidate.draft, candidate.fingerprint, self.port, "stable")
        self._stable_draft, self._stable_fp = candidate.draft, candidate.fingerprint

    def remove_canary(self) -> None:
        if self._stable is None:
            raise LocalRolloutError("no stable server to send the traffic to")
        self.router.set_weights({self.stable_url: 100, self.canary_url: 0})
        self.canary_serving.clear()
        if self._canary is not None:
            self._drain(self.canary_url, "canary")
            self._canary.stop()
            self._say(f"canary of draft {self._canary_fp} stopped; the stable serves all traffic")
        self._canary, self._canary_fp, self._canary_started_at = None, None, None


# ---- a rollout under replayed traffic --------------------------------------------------------------------


def rollout_under_traffic(backend: LocalBackend, candidate: "Candidate", prompts: Sequence["Prompt"], *,
                          traffic: "TrafficLog", settings: RolloutSettings, history: "LoopHistory | None",
                          target_fingerprint: str, concurrency: int = 8, max_tokens: int = 96,
                          rounds: int = 1, say: Callable[[str], None] = print,
                          ) -> tuple["Decision", list["ReplayResult"]]:
    """:func:`~peagle.rollout.controller.run_rollout` on ``backend`` while ``prompts`` are replayed through its
    router (greedy), ``rounds`` times, from the moment the canary gets traffic (requests sent before would
    not count). Returns the decision and the replays (each row says which server answered). The replay
    ends with its prompts, decided or not: without enough requests by ``settings.window_s`` the rollout
    rolls back."""
    results: list["ReplayResult"] = []
    failure: list[BaseException] = []
    stop = threading.Event()

    def send() -> None:
        try:
            while not backend.canary_serving.wait(1.0):
                if stop.is_set():
                    return
            for _ in range(rounds):
                if stop.is_set():
                    return
                results.append(replay(backend.router, prompts, concurrency=concurrency, max_tokens=max_tokens,
                                      temperature=0.0, progress=say))
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            failure.append(exc)

    sender = threading.Thread(target=send, name="peagle-rollout-traffic", daemon=True)
    sender.start()
    try:
        decision = run_rollout(backend, candidate, traffic=traffic, settings=settings, history=history,
                               target_fingerprint=target_fingerprint, stable_draft=backend.stable_draft, say=say)
    finally:
        stop.set()  # no further round; on an error the caller stops the servers and the replay's requests fail
    sender.join()  # the round in progress ends (the traffic goes on while it is applied)
    if failure:
        raise failure[0]
    return decision, results


# ---- the candidate ---------------------------------------------------------------------------------------


def candidate_of(draft: str, gate: str | None = None) -> "Candidate":
    """The local rollout's candidate: a published draft directory (no chart values: nothing is rendered).

    ``gate``: where its gate result is (gate.json or a gate output), verified as ``peagle rollout`` verifies
    it (:func:`.assemble.read_gate`: a gate of this draft, and passed), then summarized with the decision."""
    summary = None
    if gate:
        summary = read_gate(gate, draft).summary(str(gate))
    return Candidate(draft=str(draft), fingerprint=identify_draft(draft).fingerprint, values={}, gate=summary)
