"""What the train component does: train the draft (in this pod, or through a TrainJob) and publish it.

``pod``: the step's own pod runs :mod:`.train_worker` (torchrun with one process per GPU of the
step's accelerator limit). ``trainjob``: the step is a light launcher -- it renders a TrainJob for
the cluster profile's trainer settings, creates it and follows it (:mod:`.trainjob`). Either way the
servable draft from ``<run>/train/final`` is republished as ``<run>/models/draft`` next to the
target, the layout the serving chart reads.
"""
from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import Field

from ..config import MAX_DURATION_S, StrictModel
from ..deploy.values import DnsSubdomain, ImageRef, LabelKey, LabelValue, Quantity, ResourceName
from ..stage_io import copy_published, join
from .layout import RunLayout
from .progress import stage
from ..deploy.kube import current_namespace
from .trainjob import (JOB_ID_LABEL, RUN_LABEL, TrainJobLauncher, TrainJobSpec, build_trainjob,
                       label_value, trainjob_name)


class TrainError(RuntimeError):
    """Training did not produce a draft (the message says why)."""


class TrainJobSettings(StrictModel):
    """Cluster side of ``train_mode=trainjob`` (from the cluster profile, fixed at compile time)."""

    image: ImageRef = Field("quay.io/peagle/peagle-trainer:0.1.0", description="image of the TrainJob's nodes")
    runtime: DnsSubdomain = Field("peagle-torch", description="ClusterTrainingRuntime the TrainJob references: the one "
                         "of this profile's GPU pool (`peagle pipeline render` writes it)")
    resources: dict[Literal["requests", "limits"], dict[LabelKey, Quantity]] = Field(
        default_factory=dict, description="per-node requests/limits besides the GPUs")
    accelerator: ResourceName = Field("nvidia.com/gpu", description="extended resource name of the GPUs")
    node_selector: dict[LabelKey, LabelValue] = Field(default_factory=dict)
    tolerations: list[dict[str, Any]] = Field(default_factory=list)
    env: dict[str, str] = Field(default_factory=dict, description="extra environment of the training processes")
    queue_name: str = Field("", description="Kueue LocalQueue for the TrainJob (label kueue.x-k8s.io/queue-name); "
                            "empty: the profile's accelerator.queue_name",
                            pattern=r"^([a-z0-9]([-a-z0-9.]{0,61}[a-z0-9])?)?$")
    timeout_s: float = Field(86400.0, gt=0, le=MAX_DURATION_S, description="give up (and suspend the job) this long "
                             "after it was created, across attempts of the step; the launcher enforces it (not "
                             "every Trainer API has a deadline field)")
    startup_grace_s: float = Field(300.0, gt=0, le=MAX_DURATION_S, description="fail when the job shows only Warning events "
                                   "(e.g. its JobSet was refused) for this long")
    poll_interval_s: float = Field(30.0, gt=0, le=3600, description="status poll interval")
    pod_error_grace_s: float = Field(600.0, gt=0, le=MAX_DURATION_S, description="fail (and suspend the job) when "
                                     "a pod of it stays this long in CreateContainerConfigError, ImagePullBackOff "
                                     "or ErrImagePull")
    unschedulable_grace_s: float = Field(1800.0, gt=0, le=MAX_DURATION_S, description="fail (and suspend the job) "
                                         "when a pod of it stays Pending unschedulable this long (room for a "
                                         "cluster autoscaler to add a node)")


def gpu_limit_text(num_gpus: int) -> str:
    """``num_gpus`` as the text an accelerator limit takes (KFP resolves the count as a string)."""
    n = int(float(num_gpus))  # kfp.local hands numbers over as floats
    if not 1 <= n <= 64:
        raise TrainError(f"num_gpus={num_gpus} must be between 1 and 64")
    return str(n)


def check_extraction(layout: RunLayout) -> dict[str, Any]:
    """The training split's extraction manifest; fails early and clearly when extraction did not complete.

    This is the fan-in of the extract workers: train runs after all of them (``.after`` the loop) and
    reads what they published, so no data passes through KFP."""
    from ..extract import dataset_manifest

    manifest = dataset_manifest(layout.hidden_states("train"))
    if manifest is None:
        raise TrainError(f"{layout.hidden_states('train')} is not published: extraction did not complete "
                         "(an extract worker failed? Or this pipeline starts training beside extraction "
                         "(profile train_beside_extract), which needs train.data_mode=streaming)")
    return manifest


def _extraction_summary(manifest: dict[str, Any]) -> str:
    flat = {**manifest, **(manifest.get("totals") or {})}
    keys = ("num_samples", "num_tokens", "num_shards", "backend", "storage_dtype")
    return ", ".join(f"{k}={flat[k]}" for k in keys if k in flat) or "complete"


def trainjob_for(run_uri: str, num_nodes: int, num_gpus: int, settings: TrainJobSettings, data_connection: str,
                 namespace: str, job_id: str = "") -> dict[str, Any]:
    """The TrainJob object of this run."""
    resources = {k: dict(v) for k, v in settings.resources.items()}
    for kind in ("requests", "limits"):
        resources.setdefault(kind, {})[settings.accelerator] = str(num_gpus)
    run_name = run_uri.rstrip("/").rsplit("/", 1)[-1]
    labels = {RUN_LABEL: label_value(run_name)}
    if job_id:
        labels[JOB_ID_LABEL] = label_value(job_id)
    spec = TrainJobSpec(
        name=trainjob_name(job_id or run_name), namespace=namespace, run_uri=run_uri,
        image=settings.image, data_connection=data_connection, num_nodes=num_nodes, num_proc_per_node=num_gpus,
        runtime=settings.runtime, resources=resources, env=settings.env, labels=labels,
        queue_name=settings.queue_name)
    return build_trainjob(spec)


def train(run_uri: str, mode: str, num_gpus: int | None = None,
          cluster: str = "", data_connection: str = "", job_id: str = "",
          launcher: TrainJobLauncher | None = None) -> str:
    """Train the run's draft (``mode`` ``pod`` or ``trainjob``); returns the URI of the published draft.

    ``num_gpus``: processes per node (default: the run's ``num_gpus``); ``launcher``: for tests.
    """
    from .steps import load_run
    from .train_worker import run_training

    with stage(f"train[{mode}]") as info:
        run, layout = load_run(run_uri)
        if run.config.train.data_mode == "streaming":  # the trainer reads shard sets as the workers publish them
            print(f"streaming: training on {layout.hidden_states('train')} while it is extracted", flush=True)
        else:
            manifest = check_extraction(layout)
            print(f"extracted: {_extraction_summary(manifest)}", flush=True)
        if mode == "pod":
            code = run_training(run_uri, int(num_gpus or run.params.num_gpus))
            if code != 0:
                raise TrainError(f"training processes exited with status {code}")
        elif mode == "trainjob":
            settings = TrainJobSettings.model_validate(json.loads(cluster or "{}"))
            if not data_connection:
                raise TrainError("train_mode=trainjob needs the data connection (secret) name")
            job = trainjob_for(run_uri, run.params.num_nodes, int(num_gpus or run.params.num_gpus), settings,
                               data_connection, current_namespace(), job_id)
            if launcher is None:
                from ..deploy.kube import Apis

                apis = Apis.from_environment()
                launcher = TrainJobLauncher(apis.custom, apis.core, poll_interval_s=settings.poll_interval_s,
                                            timeout_s=settings.timeout_s, startup_grace_s=settings.startup_grace_s,
                                            pod_error_grace_s=settings.pod_error_grace_s,
                                            unschedulable_grace_s=settings.unschedulable_grace_s)
            done = launcher.run(job)
            info["trainjob"] = done["metadata"]["name"]
        else:
            raise TrainError(f"unknown train mode {mode!r}; expected 'pod' or 'trainjob'")
        draft = copy_published(join(layout.train, "final"), layout.draft)
        print(f"draft published at {draft}", flush=True)
    return draft
