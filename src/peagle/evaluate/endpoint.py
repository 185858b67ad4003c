"""Evaluation against a served vLLM (``vllm serve``, a KServe InferenceService), over HTTP.

Per workload: read the Prometheus text at ``/metrics``, send the workload's chat requests
(``/v1/chat/completions``, ``endpoint_concurrency`` at a time), read ``/metrics`` again; the
difference of the two spec-decode snapshots (:mod:`peagle.evaluate.counters`, the same normaliser
as the offline API) is this workload's count. Other traffic on a shared server would be counted
too, so evaluate on an endpoint nobody else is using.

K is what the server runs: the length of its per-position acceptance vector. Token ids come back
when the server honours vLLM's ``return_token_ids``; otherwise outputs are compared as text.
"""
from __future__ import annotations

import json
import os
import ssl
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from .counters import counts_from_prometheus_text
from .live import BASELINE, EngineRun, Workload, WorkloadResult
from .settings import EvaluateSettings


class EndpointError(RuntimeError):
    """The endpoint could not be used; the message names the URL and what went wrong."""


class EndpointClient:
    """Minimal OpenAI-compatible client (stdlib only) plus the Prometheus metrics page."""

    def __init__(self, base_url: str, *, token: str | None = None, insecure: bool = False, timeout: float = 600.0,
                 metrics_url: str | None = None):
        self.base = base_url.rstrip("/")
        self.metrics_url = metrics_url or f"{self.base}/metrics"
        self.token = token
        self.timeout = timeout
        self.context = ssl._create_unverified_context() if insecure else None  # noqa: S323 - asked for explicitly

    def _request(self, url: str, body: dict[str, Any] | None = None) -> bytes:
        headers = {"Accept": "application/json, text/plain"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        req = urllib.request.Request(url, data=data, headers=headers, method="POST" if data else "GET")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout, context=self.context) as resp:
                return resp.read()
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")[:500]
            raise EndpointError(f"{url}: HTTP {exc.code}: {detail}") from None
        except (urllib.error.URLError, TimeoutError, ConnectionError) as exc:
            raise EndpointError(f"{url}: {exc}") from None

    def models(self) -> list[str]:
        data = json.loads(self._request(f"{self.base}/v1/models"))
        return [m["id"] for m in data.get("data", [])]

    def metrics_text(self) -> str:
        return self._request(self.metrics_url).decode()

    def chat(self, model: str, messages: list[dict[str, str]], params: dict[str, Any]) -> dict[str, Any]:
        body = {"model": model, "messages": messages, "return_token_ids": True, **params}
        data = json.loads(self._request(f"{self.base}/v1/chat/completions", body))
        choice = data["choices"][0]
        token_ids = choice.get("token_ids")
        usage = data.get("usage") or {}
        return {"text": choice["message"].get("content") or "",
                "token_ids": list(token_ids) if token_ids is not None else None,
                "completion_tokens": int(usage.get("completion_tokens", len(token_ids or [])))}


def client_for(settings: EvaluateSettings, url: str) -> EndpointClient:
    token = os.environ.get(settings.endpoint_token_env) if settings.endpoint_token_env else None
    metrics = settings.metrics_url if url == settings.endpoint and settings.metrics_url else None
    return EndpointClient(url, token=token or None, insecure=settings.endpoint_insecure,
                          timeout=settings.request_timeout_s, metrics_url=metrics)


def _params(w: Workload) -> dict[str, Any]:
    p: dict[str, Any] = {"max_tokens": w.max_tokens, "temperature": w.sampling.temperature, "seed": w.sampling.seed}
    if not w.sampling.greedy:
        p["top_p"] = w.sampling.top_p
    if w.ignore_eos:
        p["ignore_eos"] = True  # a vLLM extension of the OpenAI API
    return p


def run_workloads(client: EndpointClient, model: str, workloads: list[Workload], concurrency: int,
                  expect_draft: bool) -> EngineRun:
    """All workloads against one endpoint; counters differenced around each workload."""
    results: dict[str, WorkloadResult] = {}
    k = 0
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        for w in workloads:
            before = counts_from_prometheus_text(client.metrics_text(), model)
            t = time.perf_counter()
            replies = list(pool.map(lambda chat, w=w: client.chat(model, chat, _params(w)), w.chats))
            elapsed = time.perf_counter() - t
            after = counts_from_prometheus_text(client.metrics_text(), model)
            counts = after.minus(before)
            k = max(k, after.num_positions)
            ids = [r["token_ids"] for r in replies]
            results[w.name] = WorkloadResult(
                name=w.name, counts=counts, generated_tokens=sum(r["completion_tokens"] for r in replies),
                elapsed_s=elapsed, texts=[r["text"] for r in replies],
                token_ids=None if any(i is None for i in ids) else ids)
    if expect_draft and k == 0:
        raise EndpointError(f"{client.base} reports no spec-decode counters: it is not serving a draft "
                            "(or its /metrics are elsewhere: set metrics_url)")
    return EngineRun(k if expect_draft else BASELINE, results)


def run_endpoints(settings: EvaluateSettings, workloads: list[Workload]) -> list[EngineRun]:
    """The baseline endpoint (when given) and the draft endpoint, as :class:`EngineRun` records."""
    runs = []
    targets = [(settings.baseline_endpoint, False)] if settings.baseline_endpoint else []
    targets.append((settings.endpoint, True))
    for url, expect_draft in targets:
        client = client_for(settings, url)
        model = settings.endpoint_model or next(iter(client.models()), "")
        if not model:
            raise EndpointError(f"{url}/v1/models lists no model; set endpoint_model")
        runs.append(run_workloads(client, model, workloads, settings.endpoint_concurrency, expect_draft))
    return runs


__all__ = ["EndpointClient", "EndpointError", "run_endpoints", "run_workloads"]
