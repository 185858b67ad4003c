"""One chat request against an OpenAI-compatible endpoint: proof that the deployment answers.

Standard library only (urllib), so it runs in any image. ``token`` is sent as a bearer token when the
endpoint sits behind OpenShift AI auth; it is never logged.
"""
from __future__ import annotations

import json
import ssl
import urllib.error
import urllib.request
from typing import Any


class SmokeTestError(RuntimeError):
    """The endpoint did not answer a chat request with a completion."""


def chat(base_url: str, model: str, *, prompt: str = "Say hello in five words.", max_tokens: int = 16,
         timeout: float = 120, token: str | None = None, verify_tls: bool = True) -> dict[str, Any]:
    """POST ``{base_url}/v1/chat/completions``; returns the parsed response (``choices`` non-empty)."""
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": prompt}],
                       "max_tokens": max_tokens, "temperature": 0}).encode()
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    url = base_url.rstrip("/") + "/v1/chat/completions"
    req = urllib.request.Request(url, data=body, headers=headers, method="POST")
    ctx = None
    if not verify_tls:  # opt-in, for routes with self-signed certificates
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    try:
        with urllib.request.urlopen(req, timeout=timeout, context=ctx) as resp:
            data = json.loads(resp.read())
    except urllib.error.HTTPError as e:
        detail = e.read().decode(errors="replace")[:500]
        raise SmokeTestError(f"{url} answered HTTP {e.code}: {detail}") from None
    except (urllib.error.URLError, TimeoutError, ConnectionError) as e:
        raise SmokeTestError(f"{url} unreachable: {e}") from None
    except ValueError as e:
        raise SmokeTestError(f"{url} returned invalid JSON: {e}") from None
    if not data.get("choices"):
        raise SmokeTestError(f"{url} returned no choices: {str(data)[:500]}")
    return data


def metrics(base_url: str, timeout: float = 30, token: str | None = None) -> str:
    """The Prometheus exposition text at ``{base_url}/metrics``."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    req = urllib.request.Request(base_url.rstrip("/") + "/metrics", headers=headers)
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return resp.read().decode()
