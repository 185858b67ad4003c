"""Submit the compiled pipeline to a Kubeflow Pipelines / OpenShift AI pipeline server (kfp.Client).

Host and token come from the arguments or the environment: ``KF_PIPELINES_ENDPOINT`` (the
variable ``kfp.Client`` itself reads) or ``KFP_HOST``; ``KF_PIPELINES_TOKEN`` or ``KFP_TOKEN``
(e.g. ``oc whoami -t``). The token is handed to the client only, never printed.

Before it creates a run, :func:`submit` asks the server for its version (``/apis/v2beta1/healthz``)
and refuses one older than the pipeline needs (:data:`peagle.support.MIN_KFP_BACKEND`).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import PeagleError

HOST_ENV = ("KF_PIPELINES_ENDPOINT", "KFP_HOST")
TOKEN_ENV = ("KF_PIPELINES_TOKEN", "KFP_TOKEN")


class SubmitError(PeagleError, RuntimeError):
    """The run could not be submitted (no host, server error)."""


@dataclass
class Submitted:
    run_id: str
    url: str


def _first_env(names: tuple[str, ...]) -> str | None:
    for n in names:
        v = (os.environ.get(n) or "").strip()
        if v:
            return v
    return None


def make_client(host: str | None = None, token: str | None = None, namespace: str | None = None,
                verify_ssl: bool = True) -> Any:
    import kfp

    host = host or _first_env(HOST_ENV)
    if not host:
        raise SubmitError("no pipeline server: pass --host URL or set KF_PIPELINES_ENDPOINT")
    token = token or _first_env(TOKEN_ENV)
    return kfp.Client(host=host, existing_token=token, namespace=namespace, verify_ssl=verify_ssl)


def server_healthz(client: Any) -> dict[str, Any]:
    """The raw ``/apis/v2beta1/healthz`` answer. (The SDK's typed model drops ``tag_name``, the version.)"""
    api_client = client._healthz_api.api_client
    resp = api_client.call_api("/apis/v2beta1/healthz", "GET", auth_settings=["Bearer"],
                               _preload_content=False, _return_http_data_only=True, _request_timeout=30)
    data = resp.data if hasattr(resp, "data") else resp
    return json.loads(data or b"{}")


def check_server(client: Any) -> str:
    """Refuse a pipeline server older than the pipeline needs; returns a line to print."""
    from ..support import check_backend_version

    try:
        healthz = server_healthz(client)
    except Exception as exc:  # noqa: BLE001 - an unreadable healthz is not proof of an old server
        return f"pipeline server version unknown ({type(exc).__name__}: {exc})"
    return check_backend_version(healthz)


def submit(package: str | os.PathLike, arguments: dict[str, Any], *, client: Any = None, host: str | None = None,
           token: str | None = None, namespace: str | None = None, experiment: str | None = None,
           run_name: str | None = None, verify_ssl: bool = True) -> Submitted:
    """Create a run of the compiled ``package`` with ``arguments`` (pipeline parameters)."""
    if not Path(package).is_file():
        raise SubmitError(f"compiled pipeline not found: {package}")
    client = client or make_client(host, token, namespace, verify_ssl)
    if hasattr(client, "_healthz_api"):
        from ..support import BackendVersionError

        try:
            print(check_server(client), flush=True)
        except BackendVersionError as exc:
            raise SubmitError(str(exc)) from None
    run = client.create_run_from_pipeline_package(str(package), arguments=arguments, run_name=run_name,
                                                  experiment_name=experiment, namespace=namespace,
                                                  enable_caching=False)
    run_id = getattr(run, "run_id", None) or str(run)
    base = getattr(client, "_uihost", None) or host or _first_env(HOST_ENV) or ""
    return Submitted(run_id, f"{base.rstrip('/')}/#/runs/details/{run_id}" if base else run_id)
