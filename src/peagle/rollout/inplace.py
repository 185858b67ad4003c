"""Promotion by swap on a cluster (issue #41): the stable's running pods load the candidate's draft in place.

:class:`PodSwap` is what :class:`peagle.rollout.cluster.ClusterBackend` promotes with when the stable release
serves the swap endpoint (chart ``swap.enabled``; :mod:`peagle.traffic.swap`) and ``rollout.in_place`` is on:

1. the draft pointer ``<runtime>-draft`` (:mod:`peagle.swap.pointer`) is written first, naming the candidate
   over the stable's pod template: from then on a pod that starts -- rescheduled, scaled up, crashed -- loads
   the candidate before it reports ready, and the rollout reads the stable as serving the candidate;
2. the stable Deployment's ready pods are asked, one at a time, which draft they serve
   (``GET /peagle/v1/draft`` on the pod's own address: ``http://<pod IP>:<port>``, so the rollout must run
   where pod IPs are reachable -- the pipeline's step, a Job; the API server's pod proxy drops the
   ``Authorization`` header the endpoint needs) and each that serves another is told to swap: its answer, the
   draft its workers serve once the swap is done, confirms it;
3. until every pod of the Deployment is ready and serves the candidate (a pod that was starting loads it
   through the pointer), within ``ready_timeout_s``.

The pod template never changes, so no pod restarts and the canary keeps only its share of the traffic
meanwhile. A pod that refuses or fails the swap (:class:`~peagle.traffic.swap.SwapFailed`) stops this:
the backend falls back to the restart (all traffic to the canary, the stable's template changed).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from ..deploy import kube
from ..traffic.swap import SwapFailed, served_draft, swap_draft

if TYPE_CHECKING:
    from .objects import Candidate


@dataclass
class PodSwap:
    """How to reach the stable's pods' swap endpoint: the bearer token, the serving port; ``swapper`` and
    ``reader`` are :func:`~peagle.traffic.swap.swap_draft` and :func:`~peagle.traffic.swap.served_draft`
    (a test passes stand-ins for pods it cannot run)."""

    token: str
    port: int
    timeout_s: float = 600.0
    swapper: Callable[..., dict] = field(default=swap_draft, repr=False)
    reader: Callable[..., str | None] = field(default=served_draft, repr=False)

    def __post_init__(self) -> None:
        if not self.token:
            raise ValueError("a pod swap needs the swap endpoint's token")

    def url(self, pod: dict) -> str:
        ip = (pod.get("status") or {}).get("podIP")
        if not ip:
            raise SwapFailed(f"pod {pod['metadata']['name']} has no IP yet")
        host = f"[{ip}]" if ":" in ip else ip
        return f"http://{host}:{self.port}"


def deployment_pods(apis: kube.Apis, namespace: str, deployment: dict) -> list[dict]:
    """The pods of ``deployment`` (by its selector's matchLabels), terminating ones left out."""
    labels = (((deployment.get("spec") or {}).get("selector") or {}).get("matchLabels") or {})
    if not labels:
        raise SwapFailed(f"Deployment/{deployment['metadata']['name']} has no matchLabels selector to find its pods by")
    selector = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
    listing = kube.to_dict(apis.core.list_namespaced_pod(namespace=namespace, label_selector=selector))
    return [p for p in listing.get("items") or [] if not (p.get("metadata") or {}).get("deletionTimestamp")]


def swap_pods(apis: kube.Apis, namespace: str, deployment_name: str, candidate: "Candidate", swap: PodSwap, *,
              timeout_s: float, interval: float, clock: Callable[[], float] = time.monotonic,
              sleep: Callable[[float], None] = time.sleep, say: Callable[[str], None] = print) -> int:
    """Steps 2 and 3 of the module docstring; returns how many pods swapped (those already serving the
    candidate count none). :class:`SwapFailed` when a pod refuses, fails or cannot be reached;
    :class:`~peagle.deploy.kube.DeployTimeout` when the pods do not all serve it within ``timeout_s``."""
    deadline = clock() + timeout_s
    swapped = 0
    while True:
        dep = kube.read(apis, "Deployment", "apps/v1", deployment_name, namespace)
        if dep is None:
            raise SwapFailed(f"Deployment/{deployment_name} not found in {namespace}")
        pods = deployment_pods(apis, namespace, dep)
        ready = [p for p in pods if kube.pod_ready(p)]
        for pod in ready:
            name, url = pod["metadata"]["name"], swap.url(pod)
            if swap.reader(url, swap.token) == candidate.fingerprint:
                continue
            # its answer names the draft its workers serve after the swap: swap_draft refuses any other
            answer = swap.swapper(url, swap.token, candidate.draft, candidate.fingerprint, timeout_s=swap.timeout_s)
            swapped += 1
            say(f"pod {name}: serves draft {candidate.fingerprint} (swapped in {answer.get('seconds')} s, confirmed)")
        want = int((dep.get("spec") or {}).get("replicas", 1) or 0)
        if len(ready) == len(pods) and len(ready) >= want:
            return swapped
        if clock() >= deadline:
            raise kube.DeployTimeout(f"Deployment/{deployment_name} in {namespace}: {len(ready)} of {len(pods)} pods "
                                     f"ready ({want} wanted) after {timeout_s:.0f}s; the ready ones serve draft "
                                     f"{candidate.fingerprint}, the others load it when they start (draft pointer)")
        sleep(interval)
