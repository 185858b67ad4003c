"""One chat request against an OpenAI-compatible endpoint: proof that the deployment answers.

The HTTP side (standard library only, retries on 429/5xx and connection errors: a route answers 503
for a moment after the InferenceService reports Ready) is :class:`peagle.engine.client.OpenAIClient`.
``token`` is sent as a bearer token when the endpoint sits behind OpenShift AI auth; it is never logged.
"""
from __future__ import annotations

from typing import Any

from ..engine.client import EndpointError, OpenAIClient
from ..errors import PeagleError


class SmokeTestError(PeagleError, RuntimeError):
    """The endpoint did not answer a chat request with a completion."""

    exit_code = 1


def chat(base_url: str, model: str, *, prompt: str = "Say hello in five words.", max_tokens: int = 16,
         timeout: float = 120, token: str | None = None, verify_tls: bool = True) -> dict[str, Any]:
    """POST ``{base_url}/v1/chat/completions``; returns the parsed response (``choices`` non-empty)."""
    client = OpenAIClient(base_url.rstrip("/") + "/v1", token=token, verify_tls=verify_tls, timeout=timeout)
    try:
        return client.chat({"model": model, "messages": [{"role": "user", "content": prompt}],
                            "max_tokens": max_tokens, "temperature": 0})
    except EndpointError as e:
        raise SmokeTestError(str(e)) from None


def require_model(base_url: str, model: str, *, timeout: float = 60, token: str | None = None,
                  verify_tls: bool = True) -> None:
    """Raise :class:`SmokeTestError` unless ``GET {base_url}/v1/models`` lists ``model``: the proof that
    the rollout serving the endpoint is the one whose served names include it (the draft fingerprint)."""
    client = OpenAIClient(base_url.rstrip("/") + "/v1", token=token, verify_tls=verify_tls, timeout=timeout)
    try:
        served = client.models()
    except EndpointError as e:
        raise SmokeTestError(str(e)) from None
    if model not in served:
        raise SmokeTestError(f"the endpoint serves {', '.join(served) or 'no model'}, not {model}: "
                             "an older rollout answered")


def metrics(base_url: str, timeout: float = 30, token: str | None = None) -> str:
    """The Prometheus exposition text at ``{base_url}/metrics``."""
    try:
        return OpenAIClient(base_url.rstrip("/") + "/v1", token=token, timeout=timeout).metrics_text()
    except EndpointError as e:
        raise SmokeTestError(str(e)) from None
