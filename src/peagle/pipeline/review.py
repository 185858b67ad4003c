"""``peagle pipeline render``: every Kubernetes object a run of the pipeline would create, for review.

A platform admin reads these before a run, the way ``helm template`` shows a chart: the
ClusterTrainingRuntime the profile needs (installed once per GPU pool by an admin), the TrainJob of
``train_mode=trainjob`` for one run id and node count, and the serving objects the deploy step
applies. The objects come from the same functions the pipeline steps call at run time.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from .deployment import ServingSettings, serving_objects
from .layout import run_uri
from .profile import ClusterProfile
from .runtime import cluster_training_runtime
from .training import trainjob_for

SAMPLE_RUN_ID = "00000000-0000-0000-0000-000000000000"


def run_objects(profile: ClusterProfile, *, run_id: str = SAMPLE_RUN_ID, num_nodes: int = 1, num_gpus: int = 1,
                namespace: str = "peagle", data_connection: str = "aws-connection-peagle",
                output_root: str = "s3:///peagle/runs", deploy_name: str = "peagle", deploy_mode: str = "kserve",
                num_speculative_tokens: int = 4) -> list[dict[str, Any]]:
    """The objects in apply order: runtime (cluster-scoped), TrainJob, serving objects."""
    uri = run_uri(output_root, "", run_id)
    settings = profile.resolved_trainjob()
    objs = [cluster_training_runtime(profile),
            trainjob_for(uri, num_nodes, num_gpus, settings, data_connection, namespace, run_id)]
    if deploy_mode != "none":
        serving = ServingSettings.model_validate(json.loads(profile.serving_json()))
        objs += serving_objects(uri, deploy_name, deploy_mode, data_connection, num_speculative_tokens, serving,
                                namespace)
    return objs


def write_objects(objs: list[dict[str, Any]], out: str | Path) -> list[Path]:
    """One ``NN-kind-name.yaml`` per object; returns the paths."""
    from ..deploy import write_manifests

    return write_manifests(objs, out)


def dump(objs: list[dict[str, Any]]) -> str:
    return yaml.safe_dump_all(objs, sort_keys=False)
