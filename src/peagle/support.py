"""What peagle runs on: the support matrix, stated once, and the checks that hold the code to it.

The README's table is rendered from :data:`MATRIX` (``python -m peagle.support``). Each minimum is
backed by a test or an upstream fact named in ``source``. :data:`MIN_KFP_BACKEND` is held two ways:

* ``tests/support/kfp_features.py`` lists the Kubeflow Pipelines features a compiled pipeline uses with the
  backend version each needs; ``tests/unit/test_support.py`` fails when the committed pipeline needs more;
* :func:`check_backend_version` is what ``peagle pipeline submit`` runs against the server's
  ``/apis/v2beta1/healthz`` before it creates a run.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

Version = tuple[int, int, int]

MIN_KFP_BACKEND: Version = (2, 5, 0)


@dataclass(frozen=True)
class Requirement:
    component: str
    supported: str
    why: str
    source: str


MATRIX: tuple[Requirement, ...] = (
    Requirement("Kubeflow Pipelines backend", ">= 2.5.0 (OpenShift AI >= 2.22; Open Data Hub DSP >= 2.14)",
                "secret names from a pipeline parameter (data_connection) and the run-id placeholder are "
                "resolved from 2.5.0; nothing newer is used (train fans in through the object store, optional "
                "Secret keys come from a mounted Secret)",
                "tests/unit/test_support.py (IR features); kubeflow/pipelines #11770, #11599; OpenShift AI's "
                "data-science-pipelines VERSION per rhoai-X.Y branch"),
    Requirement("Kubeflow Trainer (train_mode=trainjob)", "upstream v2.0-v2.3; OpenShift AI 3.2-3.5",
                "the TrainJob uses only fields every one of them has (runtimeRef, trainer.*, labels); the GPU "
                "pool, volumes and deadline live in the ClusterTrainingRuntime and the launcher",
                "tests/unit/pipeline/test_trainjob.py validates strictly against Trainer v2.3.0 and OpenShift AI 3.5 CRDs"),
    Requirement("JobSet", "any (its webhook limits pod names to 63 characters)",
                "TrainJob names are at most 43 characters: room for 256 nodes and 9 retries",
                "tests/unit/pipeline/test_trainjob.py; kubernetes-sigs/jobset pkg/webhooks/jobset_webhook.go"),
    Requirement("KServe", "v1beta1 InferenceService; >= 0.16 only for storage.type=uris; a data connection on "
                "OpenShift AI (default) or, with kserve.openshiftAI=false, on upstream KServe",
                "predictor.storageUris (separate target and draft locations) arrived in 0.16; on OpenShift AI the "
                "connection reaches KServe as `storage.key`, through the storage-config Secret only "
                "odh-model-controller creates; upstream the chart renders `storageUri: s3://<bucket>/<path>` and a "
                "ServiceAccount whose secret is the connection (KServe's S3 credential convention; the bucket must "
                "be given)",
                "kserve/kserve #4702, pkg/credentials (v0.15); tests/integration/helm/test_chart.py and "
                "tests/integration/helm/test_deploy_cluster_helm.py against the KServe CRD"),
    Requirement("vLLM", ">= 0.16.0 for P-EAGLE (pinned: 0.32.0)",
                "`parallel_drafting` in the speculative config", "vllm-project/vllm #32887; tests/integration/vllm/test_vllm_serving.py"),
    Requirement("NVIDIA driver", ">= 580.65.06 (CUDA 13.0: trainer image, cu130 torch)",
                "the trainer image's torch is a CUDA 13.0 build; the vLLM image follows vllm/vllm-openai's CUDA",
                "NVIDIA CUDA Toolkit release notes, driver table"),
)


# --------------------------------------------------------------------------------------------------
# The server's version

class BackendVersionError(RuntimeError):
    """The pipeline server is older than :data:`MIN_KFP_BACKEND`."""


def parse_version(text: str) -> Version | None:
    """``"2.5.0"``, ``"v2.14.3"``, ``"2.16.1-rc.1"`` -> a tuple; None for "unknown" or garbage."""
    m = re.match(r"^v?(\d+)\.(\d+)(?:\.(\d+))?", (text or "").strip())
    return (int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)) if m else None


def fmt(version: Version) -> str:
    return ".".join(map(str, version))


def check_backend_version(healthz: dict[str, Any]) -> str:
    """Judge a ``/apis/v2beta1/healthz`` answer; returns a line to print, raises when too old.

    Red Hat's builds report ``tag_name: "unknown"``: then the version cannot be told, and the line
    says so (the run goes ahead; OpenShift AI >= 2.22 is the requirement)."""
    tag = str(healthz.get("tag_name") or "")
    version = parse_version(tag)
    if version is None:
        return (f"pipeline server version not reported (tag_name={tag or 'missing'!r}); peagle needs KFP "
                f">= {fmt(MIN_KFP_BACKEND)} (OpenShift AI >= 2.22)")
    if version < MIN_KFP_BACKEND:
        raise BackendVersionError(f"the pipeline server runs Kubeflow Pipelines {tag}; peagle's pipeline needs "
                                  f">= {fmt(MIN_KFP_BACKEND)} (OpenShift AI >= 2.22): upgrade the server")
    return f"pipeline server: Kubeflow Pipelines {tag} (>= {fmt(MIN_KFP_BACKEND)})"


def markdown_table() -> str:
    rows = ["| component | supported | why | backed by |", "| --- | --- | --- | --- |"]
    rows += [f"| {r.component} | {r.supported} | {r.why} | {r.source} |" for r in MATRIX]
    return "\n".join(rows)


if __name__ == "__main__":
    print(markdown_table())
