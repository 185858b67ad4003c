"""Evaluation against a served vLLM (``vllm serve``, a KServe InferenceService), over HTTP.

Per workload: read the Prometheus text at ``/metrics``, send the workload's chat requests
(``/v1/chat/completions``, ``endpoint_concurrency`` at a time), read ``/metrics`` again; the
difference of the two spec-decode snapshots (:mod:`peagle.evaluate.counters`, the same normaliser
as the offline API) is this workload's count. Other traffic on a shared server would be counted
too, so evaluate on an endpoint nobody else is using.

K is what the server runs: the length of its per-position acceptance vector. Token ids come back
when the server honours vLLM's ``return_token_ids``; otherwise outputs are compared as text.
HTTP (retries, TLS, the token) is :class:`peagle.engine.client.OpenAIClient`.
"""
from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..engine.client import EndpointError, OpenAIClient
from .counters import counts_from_prometheus_text
from .live import BASELINE, EngineRun, Workload, WorkloadResult
from .settings import EvaluateSettings


def client_for(settings: EvaluateSettings, url: str) -> OpenAIClient:
    token = os.environ.get(settings.endpoint_token_env) if settings.endpoint_token_env else None
    metrics = settings.metrics_url if url == settings.endpoint and settings.metrics_url else None
    return OpenAIClient(url.rstrip("/") + "/v1", token=token or None, verify_tls=not settings.endpoint_insecure,
                        timeout=settings.request_timeout_s, metrics_url=metrics)


def chat(client: OpenAIClient, model: str, messages: list[dict[str, str]], params: dict[str, Any]) -> dict[str, Any]:
    """One chat request: its text, token ids (None when the server does not return them) and length."""
    data = client.chat({"model": model, "messages": messages, "return_token_ids": True, **params})
    choice = data["choices"][0]
    token_ids = choice.get("token_ids")
    usage = data.get("usage") or {}
    return {"text": choice["message"].get("content") or "",
            "token_ids": list(token_ids) if token_ids is not None else None,
            "completion_tokens": int(usage.get("completion_tokens", len(token_ids or [])))}


def _params(w: Workload) -> dict[str, Any]:
    p: dict[str, Any] = {"max_tokens": w.max_tokens, "temperature": w.sampling.temperature, "seed": w.sampling.seed}
    if not w.sampling.greedy:
        p["top_p"] = w.sampling.top_p
    if w.ignore_eos:
        p["ignore_eos"] = True  # a vLLM extension of the OpenAI API
    return p


def run_workloads(client: OpenAIClient, model: str, workloads: list[Workload], concurrency: int,
                  expect_draft: bool) -> EngineRun:
    """All workloads against one endpoint; counters differenced around each workload."""
    results: dict[str, WorkloadResult] = {}
    k = 0
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        for w in workloads:
            before = counts_from_prometheus_text(client.metrics_text(), model)
            t = time.perf_counter()
            replies = list(pool.map(lambda messages, w=w: chat(client, model, messages, _params(w)), w.chats))
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
        raise EndpointError(f"{client.root} reports no spec-decode counters: it is not serving a draft "
                            "(or its /metrics are elsewhere: set metrics_url)")
    return EngineRun(k if expect_draft else BASELINE, results)


def endpoint_model(settings: EvaluateSettings, client: OpenAIClient) -> str:
    """The model to ask for: ``endpoint_model``, else the first one the endpoint lists."""
    model = settings.endpoint_model or next(iter(client.models()), "")
    if not model:
        raise EndpointError(f"{client.api_url}/models lists no model; set endpoint_model")
    return model


def run_endpoints(settings: EvaluateSettings, workloads: list[Workload]) -> list[EngineRun]:
    """The baseline endpoint (when given) and the draft endpoint, as :class:`EngineRun` records."""
    runs = []
    targets = [(settings.baseline_endpoint, False)] if settings.baseline_endpoint else []
    targets.append((settings.endpoint, True))
    for url, expect_draft in targets:
        client = client_for(settings, url)
        model = endpoint_model(settings, client)
        runs.append(run_workloads(client, model, workloads, settings.endpoint_concurrency, expect_draft))
    return runs


__all__ = ["EndpointError", "client_for", "endpoint_model", "run_endpoints", "run_workloads"]
