"""What the deploy component does: serve the run's target + draft with vLLM (peagle-serving chart).

The run keeps ``models/target`` and ``models/draft`` under one prefix of the data-connection
bucket, which is exactly the chart's ``dataConnection`` model source (KServe's storage initializer
downloads that prefix). Modes:

* ``kserve`` / ``deployment``: render and apply (create or patch), wait until ready, send one chat
  request (:func:`peagle.deploy.deploy`); returns the endpoint URL;
* ``render``: only write the manifests to ``<run>/deploy/`` (no cluster needed; the local run);
* ``none``: do nothing.

The draft is named by its fingerprint (:func:`peagle.records.identity.identify_draft`: its weights and
config, read from the publication's manifest, nothing downloaded), the one its served records carry. The
chart puts it on the serving pods and serves the model under a second name carrying it, so the smoke
test's answer comes from the rollout of this run's draft.
"""
from __future__ import annotations

import json
from typing import Any

from pydantic import Field

from ..config import MAX_DURATION_S, StrictModel
from ..deploy.values import OptionalImageRef
from ..records.identity import identify_draft
from .layout import RunLayout, bucket_and_key
from .progress import stage

class ServingSettings(StrictModel):
    """Cluster side of serving (from the cluster profile, fixed at compile time)."""

    image: OptionalImageRef = Field("", description="vLLM image REGISTRY/PATH:TAG or ...@sha256:... "
                                    "(\"\": the chart's)")
    gpus: int | None = Field(None, ge=0, description="GPUs per replica (default: the chart's)")
    max_model_len: int | None = Field(None, ge=16)
    extra_args: list[str] = Field(default_factory=list, description="extra vLLM flags")
    values: dict[str, Any] = Field(default_factory=dict, description=(
        "extra chart values, merged last. The compiled pipeline carries the GPU pool's kueue.queueName and "
        "kserve.hardwareProfile here (ClusterProfile.resolved_serving); values set here win"))
    timeout_s: float = Field(1800.0, gt=0, le=MAX_DURATION_S, description="wait this long for Ready")


def model_location(layout: RunLayout) -> tuple[str, str]:
    """(bucket, prefix) holding target/ and draft/: the data connection's ``path`` and, when the run's
    ``output_root`` names a bucket (``s3://bucket/...``), that bucket -- it need not be the connection's.
    Local runs are only rendered: the path, made relative as a prefix must be, is informative."""
    if layout.remote:
        return bucket_and_key(layout.models)
    return "", layout.models.lstrip("/")


def draft_fingerprint(layout: RunLayout) -> str:
    """The published draft's fingerprint (see the module docstring);
    :class:`~peagle.records.identity.DraftIdentityError` naming the prefix when no draft is published there."""
    return identify_draft(layout.draft).fingerprint


def evaluated_schedule(layout: RunLayout):
    """The speculation schedule the run's evaluation chose (its published report, checksum verified), or
    None when it measured no speed (an evaluation without ``evaluate.speed``) or the run has no evaluation
    (a deploy step run on its own: the ``num_speculative_tokens`` parameter decides K)."""
    from ..evaluate import Report
    from .objects import is_published

    if not is_published(layout.evaluate):
        return None
    speed = Report.read(layout.evaluate).speed
    return speed.schedule if speed is not None else None


def serving_objects(run_uri: str, name: str, mode: str, data_connection: str, num_speculative_tokens: int,
                    settings: ServingSettings, namespace: str, draft_fingerprint: str | None = None,
                    schedule: Any = None) -> list[dict[str, Any]]:
    """The objects that serve the run's target + draft (``mode`` kserve or deployment; render = kserve).
    ``draft_fingerprint``: see :func:`draft_fingerprint` (None: the chart derives one from the settings).
    ``schedule``: the evaluation's speculation schedule; it decides K per batch size (``num_speculative_tokens``,
    the trained depths, then only bounds it)."""
    from ..deploy import render, values_for

    bucket, path = model_location(RunLayout(run_uri))
    s = settings
    values = values_for(mode="kserve" if mode == "render" else mode, data_connection=data_connection,
                        path=path, bucket=bucket,
                        num_speculative_tokens=None if schedule is not None else int(num_speculative_tokens),
                        schedule=schedule,
                        gpus=s.gpus, image=s.image or None, max_model_len=s.max_model_len,
                        draft_fingerprint=draft_fingerprint, extra_args=s.extra_args,
                        extra_values=[s.values] if s.values else [])
    return render(values, name, namespace)


def deploy(run_uri: str, name: str, mode: str, data_connection: str, num_speculative_tokens: int,
           serving: str = "", namespace: str = "", apis: Any = None) -> str:
    """Deploy (or render) the run's draft; returns the endpoint URL, or the manifests' location."""
    from ..deploy import deploy as apply_and_wait, write_manifests
    from ..stage_io import staged
    from ..deploy.kube import current_namespace

    if mode == "none":
        print("deploy_mode=none: not deploying", flush=True)
        return ""
    if mode not in ("kserve", "deployment", "render"):
        raise ValueError(f"unknown deploy mode {mode!r}; expected kserve, deployment, render or none")
    s = ServingSettings.model_validate(json.loads(serving or "{}"))
    layout = RunLayout(run_uri)
    with stage(f"deploy[{mode}]") as info:
        ns = namespace or current_namespace()
        fingerprint = draft_fingerprint(layout)
        info["draft_fingerprint"] = fingerprint
        schedule = evaluated_schedule(layout)
        if schedule is not None:
            if schedule.num_speculative_tokens > int(num_speculative_tokens):
                raise ValueError(f"the evaluation's schedule ({schedule.describe()}) drafts more than "
                                 f"num_speculative_tokens={num_speculative_tokens}")
            info["speculation_schedule"] = schedule.describe()
            print(f"speculation schedule (batch size: K): {schedule.describe()}", flush=True)
        objs = serving_objects(run_uri, name, mode, data_connection, num_speculative_tokens, s, ns, fingerprint,
                               schedule)
        with staged(layout.deploy, kind="peagle-deploy") as out:
            write_manifests(objs, out)
        info["objects"] = [f"{o['kind']}/{o['metadata']['name']}" for o in objs]
        if mode == "render":
            print(f"rendered {len(objs)} objects into {layout.deploy}: {', '.join(info['objects'])}", flush=True)
            return layout.deploy
        if apis is None:
            from ..deploy.kube import Apis

            apis = Apis.from_environment()
        url = apply_and_wait(objs, apis, timeout=s.timeout_s)
        info["endpoint"] = url
    return url
