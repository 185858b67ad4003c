"""A cluster rollout assembled from its parts, once for ``peagle rollout`` and the refresh pipeline's step.

:func:`cluster_rollout` turns the stable release's chart values, the candidate draft and the candidate's
model source into the :class:`~.objects.Candidate` and :class:`~.objects.RolloutObjects` of a rollout;
:meth:`ClusterRollout.phases` renders what each phase applies, :meth:`ClusterRollout.run` rolls it out
(:class:`~.cluster.ClusterBackend` + :func:`~.controller.run_rollout`) and publishes the decision.
:func:`read_gate` / :func:`read_lineage` check that the evidence handed in is about this candidate.
"""
from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping

from ..config import ConfigError
from ..records.decision import Decision
from ..records.gate import GateSummary
from ..records.history import LoopHistory, history_uri
from ..records.identity import identify_draft
from ..records.lineage import Lineage
from ..stage_io import join
from ..storage import StorageError, open_store, publish
from ..gate.report import GateResult
from ..traffic.log import TrafficLog
from .cluster import ClusterBackend
from .controller import RolloutError, abort_rollout, run_rollout, utc_now
from .inplace import PodSwap
from .objects import Candidate, RolloutObjects
from .settings import RolloutSettings

if TYPE_CHECKING:
    from ..deploy.kube import Apis

DECISION_DIR, DECISION_JSON = "rollout", "decision.json"  # under the run's output (``out``), beside ``promotion/``
PHASES = ("canary", "stable-with-canary", "promoted")  # in the order a promotion applies them


@dataclass(frozen=True)
class ClusterRollout:
    """The candidate and the objects of its rollout on one release."""

    candidate: Candidate
    objects: RolloutObjects

    def phases(self, percent: int) -> dict[str, list[dict]]:
        """Every phase's objects, by :data:`PHASES`: the canary to create, the stable sending it ``percent``
        of the traffic, the stable serving the candidate once promoted."""
        c = self.candidate
        return {"canary": self.objects.canary(c), "stable-with-canary": self.objects.stable(c, percent),
                "promoted": self.objects.promoted(c)}

    def run(self, apis: "Apis", *, traffic: str, settings: "RolloutSettings", target_fingerprint: str | None,
            stable_draft: str, out: str | None = None, say: Callable[[str], None] = print,
            on_decision: Callable[["Decision"], None] | None = None, clean_up: bool = False,
            clock: Callable[[], datetime] = utc_now, sleep: Callable[[float], None] = time.sleep,
            environ: Mapping[str, str] | None = None, pod_swap_io: dict | None = None) -> "Decision":
        """Roll the candidate out on the cluster behind ``apis`` and decide on the live records in the traffic
        log ``traffic``; the loop history is ``history_uri(settings.history, traffic)``. With ``out`` the decision is
        published under ``<out>/rollout/`` (``decision.json``; the decision is also the manifest's metadata) and a
        promotion under ``<out>/promotion/``.

        ``clean_up`` (the pipeline's step, whose pod holds no one's terminal): when the rollout fails, or SIGTERM
        stops it (the run terminated, the step past its deadline), before a ``promote`` decision is on record,
        the canary is removed -- its GPU freed, all traffic to the untouched stable -- and the error raised.
        After a ``promote`` decision it is left: the stable may be restarting while the canary answers
        everything, and a rerun finishes the promotion (the command's own rule: docs/traffic.md, "An
        interrupted rollout"). Promotion swaps the draft in the stable's pods where :func:`pod_swap` says so
        (the token from ``environ``, default ``os.environ``). ``clock``/``sleep``/``pod_swap_io``: injectable
        for tests."""
        waits = {} if clock is utc_now else {"clock": lambda: clock().timestamp(), "sleep": sleep}  # a test's clock
        backend = ClusterBackend(apis, self.objects, ready_timeout_s=settings.ready_timeout_s, say=say, now=clock,
                                 swap=pod_swap(self.objects, settings, environ=environ, **(pod_swap_io or {})),
                                 **waits)
        history = LoopHistory(history_uri(settings.history, traffic))
        with _sigterm_raises(clean_up):
            try:
                decision = run_rollout(backend, self.candidate, traffic=TrafficLog(traffic), settings=settings,
                                       history=history, target_fingerprint=target_fingerprint,
                                       stable_draft=stable_draft, say=say, on_decision=on_decision, out=out,
                                       clock=clock, sleep=sleep)
            except (Exception, RolloutTerminated) as exc:
                if clean_up:
                    self._clean_up(backend, history, say, exc)
                raise
        if out:
            publish_decision(decision, out)
        return decision

    def _clean_up(self, backend: ClusterBackend, history: LoopHistory, say: Callable[[str], None],
                  exc: BaseException) -> None:
        fp = self.candidate.fingerprint
        promoting = history.latest("decision", lambda d: ((d.get("versions") or {}).get("candidate") or {}).get(
            "fingerprint") == fp and d.get("decision") == "promote") is not None
        if promoting:
            say(f"the rollout stopped ({exc}) after the decision to promote draft {fp}: the canary is left serving "
                "while the stable may restart; a rerun finishes the promotion")
            return
        say(f"the rollout stopped ({exc}) before a decision to promote draft {fp}: removing its canary")
        try:
            abort_rollout(backend, say=say)
        except Exception as cleanup_exc:  # the original error is what the step reports
            say(f"could not remove the canary of draft {fp}: {cleanup_exc}; `peagle rollout --abort` removes it")


class RolloutTerminated(RolloutError):
    """SIGTERM stopped the rollout (the run was terminated, or its step passed its deadline)."""


@contextlib.contextmanager
def _sigterm_raises(active: bool) -> Iterator[None]:
    """While inside (``active``, main thread only: only it may set signal handlers): the first SIGTERM raises
    :class:`RolloutTerminated`, so the clean-up runs before the pod is killed; a second one does not interrupt
    it."""
    if not active or threading.current_thread() is not threading.main_thread():
        yield
        return
    fired: list[int] = []

    def handler(signum, frame):  # noqa: ARG001
        if not fired:
            fired.append(signum)
            raise RolloutTerminated("SIGTERM: the step was stopped")

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)


def pod_swap(objects: RolloutObjects, settings: RolloutSettings, *, environ: Mapping[str, str] | None = None,
             **io: Any) -> PodSwap | None:
    """How the stable's pods are swapped (:mod:`.inplace`), or None: promote by restart. Swapped when the stable
    release serves the swap endpoint (chart ``swap.enabled``) and ``rollout.in_place`` is on; then the endpoint's
    token must be in ``environ[settings.swap_token_env]`` (refused before anything is deployed). ``io``: a
    test's ``swapper``/``reader``."""
    if not settings.in_place or not ((objects.values.get("swap") or {}).get("enabled")):
        return None
    token = (os.environ if environ is None else environ).get(settings.swap_token_env, "").strip()
    if not token:
        raise RolloutError(f"the stable release serves the swap endpoint (swap.enabled) but {settings.swap_token_env} "
                           "is not set: give the rollout the token of swap.tokenSecret (its Secret), or set "
                           "rollout.in_place=false to promote by restart")
    return PodSwap(token=token, port=objects.serving_port(), timeout_s=settings.swap_timeout_s, **io)


def publish_decision(decision: "Decision", out: str) -> str:
    """Publish ``<out>/rollout/`` (``decision.json``; the decision record is the manifest metadata, so the run's
    published outputs carry it); returns its URI. A rerun republishes it."""
    uri = join(out, DECISION_DIR)
    publish(open_store(uri), "", {DECISION_JSON: decision.to_json().encode()}, decision.to_dict(), overwrite=True)
    return uri


def cluster_rollout(*, name: str, namespace: str, routing: str, mode: str, stable_values: Mapping[str, Any],
                    candidate_draft: str, candidate_values: dict, gate: GateSummary | None = None,
                    lineage: Lineage | None = None, chart: str | None = None) -> ClusterRollout:
    """The rollout of the published draft ``candidate_draft`` (named by its fingerprint,
    :func:`peagle.records.identity.identify_draft`) on release ``name``, which serves with ``stable_values``. ``candidate_values``: the
    chart values pointing the stable's model source at the candidate (:func:`.objects.candidate_values`);
    ``gate``: the gate's summary (:meth:`~peagle.gate.report.GateResult.summary`) or None (unvetted)."""
    candidate = Candidate(draft=str(candidate_draft), fingerprint=identify_draft(candidate_draft).fingerprint,
                          values=candidate_values, gate=gate, lineage=lineage)
    objects = RolloutObjects(name=name, namespace=namespace, routing=routing, mode=mode,
                             stable_values=stable_values, chart=chart)
    return ClusterRollout(candidate, objects)


def read_gate(location: str, candidate_draft: str) -> "GateResult":
    """The gate result at ``location`` (gate.json or a gate output), refused unless it passed the draft at
    ``candidate_draft`` (the gate names drafts by their digest, :mod:`peagle.records.identity`)."""
    result = GateResult.read(location)
    gated = (result.candidate_draft or {}).get("sha256")
    if gated != identify_draft(candidate_draft).digest:
        raise ConfigError(f"{location} is the gate of draft {(result.candidate_draft or {}).get('path')} "
                          f"(sha256 {str(gated)[:12]}...), not of the candidate {candidate_draft}")
    if not result.passed:
        raise ConfigError(f"{location}: the gate did not pass the candidate ({'; '.join(result.reasons)})")
    return result


def read_lineage(location: str, candidate_draft: str) -> Lineage:
    """The refresh's ``lineage.json`` at ``location`` (a file or URI), read strictly
    (:class:`~peagle.records.lineage.LineageError` naming the field), refused unless its candidate is the draft at
    ``candidate_draft`` (same manifest sha256)."""
    from ..model.adapter import Draft  # torch: loaded when a lineage is checked

    head, _, name = str(location).rstrip("/").rpartition("/")
    try:
        body = open_store(head or ".").get_bytes(name)
    except (OSError, StorageError) as exc:
        raise ConfigError(f"{location}: not a readable lineage.json ({exc})") from None
    lineage = Lineage.from_json(body, str(location))
    if lineage.candidate_draft.manifest_sha256 != Draft.open(candidate_draft).manifest_sha256:
        raise ConfigError(f"{location} is the lineage of draft {lineage.candidate_draft.uri}, not of the candidate "
                          f"{candidate_draft}")
    return lineage
