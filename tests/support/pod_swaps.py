"""Stand-in for the swap endpoints of the pods :class:`support.fake_kube.FakeCluster` lists (no pod, no vLLM
server runs in a cluster here): what :class:`peagle.rollout.inplace.PodSwap` calls as ``swapper`` and ``reader``.

The pods running when it is made serve their template's draft; a pod that appears later (a template change,
a scale-up) serves, when first asked, the draft its template names (label ``peagle.io/draft-fingerprint``) -- or,
as :class:`peagle.traffic.swap.StartupSwap` does, the draft of the pointer ConfigMap its pod spec mounts
(``draft-pointer`` volume, in the Deployment's pod spec or its KServe ServingRuntime's) when that pointer
names its template. A swap needs the token; ``refuse(uri)`` returning a message makes every pod refuse
that draft (as a damaged draft is refused: the pod serves on). Every swap counts as a write of the
cluster, so ``interrupt_at`` can kill the rollout between two pods. The real endpoint:
tests/integration/vllm/test_draft_swap_server_vllm.py.
"""
from __future__ import annotations

from typing import Callable

from peagle.deploy.kube import FINGERPRINT_LABEL
from peagle.swap.pointer import DraftPointer
from peagle.traffic.swap import SwapFailed
from support.fake_kube import FakeCluster


class PodEndpoints:
    def __init__(self, cluster: FakeCluster, namespace: str, token: str,
                 refuse: Callable[[str], str | None] = lambda uri: None):
        self.cluster, self.ns, self.token, self.refuse = cluster, namespace, token, refuse
        self.serving: dict[str, str] = {}  # pod name -> the draft it serves
        self.swaps: list[tuple[str, str]] = []  # (pod, draft) in the order they swapped
        for pod, dep in cluster.pods(namespace):  # the pods running now started before any pointer was written
            self._serving(pod["metadata"]["name"], pod, dep)

    def _pod(self, url: str) -> tuple[str, dict, dict]:
        ip = url.split("//", 1)[1].rsplit(":", 1)[0]
        for pod, dep in self.cluster.pods(self.ns):
            if pod["status"]["podIP"] == ip:
                return pod["metadata"]["name"], pod, dep
        raise SwapFailed(f"{url}: unreachable: no pod has IP {ip}")

    def _pointer_volume(self, dep: dict) -> str | None:
        spec = dep["spec"]["template"].get("spec") or {}
        volumes = spec.get("volumes")
        if volumes is None and "model" in spec:  # a KServe predictor: its runtime's pod spec
            runtime = self.cluster.store.get(("ServingRuntime", self.ns, spec["model"]["runtime"])) or {}
            volumes = (runtime.get("spec") or {}).get("volumes")
        return next((v["configMap"]["name"] for v in volumes or [] if v["name"] == "draft-pointer"), None)

    def _serving(self, name: str, pod: dict, dep: dict) -> str:
        if name not in self.serving:  # the pod starts: its template's draft, or its pointer's
            template = pod["metadata"]["labels"].get(FINGERPRINT_LABEL)
            self.serving[name] = template
            cm = self._pointer_volume(dep)
            live = self.cluster.store.get(("ConfigMap", self.ns, cm)) if cm else None
            if live is not None:
                pointer = DraftPointer.from_data(live["data"], cm)
                if pointer.applies_to(template):
                    self.serving[name] = pointer.fingerprint
        return self.serving[name]

    def _check(self, url: str, token: str) -> None:
        if token != self.token:
            raise SwapFailed(f"{url}/peagle/v1/draft answered 401: needs the swap token")

    def reader(self, url: str, token: str, **_) -> str | None:
        self._check(url, token)
        return self._serving(*self._pod(url))

    def swapper(self, url: str, token: str, uri: str, fingerprint: str, **_) -> dict:
        self._check(url, token)
        name, pod, dep = self._pod(url)
        previous = self._serving(name, pod, dep)
        if message := self.refuse(uri):
            raise SwapFailed(f"{url}/peagle/v1/draft answered 409: {message}", previous)
        self.serving[name] = fingerprint
        self.swaps.append((name, fingerprint))
        self.cluster.calls.append(("swap", "Pod", name))
        self.cluster._written(None)
        return {"fingerprint": fingerprint, "previous": previous, "seconds": 0.5}
