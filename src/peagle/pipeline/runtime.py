"""The ClusterTrainingRuntime of a cluster profile: torchrun on the trainer image, on the profile's GPU pool.

TrainJobs reference it by name (``trainjob.runtime`` in the profile). Everything pod-level that a
TrainJob cannot say in a way every Trainer accepts lives here: the GPU pool's node selector and
tolerations, the scratch volume with the cache environment, ``/dev/shm`` for NCCL, the security
context. One runtime per GPU pool: a profile for another pool names another runtime.

Cluster-scoped, so a cluster admin installs it (``manifests/admin`` holds the default profile's;
``peagle pipeline render --profile P`` writes any profile's).

Kubeflow Trainer injects ``PET_NNODES``, ``PET_NPROC_PER_NODE``, ``PET_NODE_RANK``, ``PET_MASTER_ADDR`` and
``PET_MASTER_PORT``, which torchrun reads as its own flags, so the command needs no rendezvous arguments.
"""
from __future__ import annotations

from typing import Any

from .profile import SCRATCH_MOUNT
from .trainjob import GROUP, TRAINER_NODE, VERSION


def cluster_training_runtime(profile: Any) -> dict[str, Any]:
    """The ClusterTrainingRuntime for ``profile`` (a :class:`peagle.pipeline.profile.ClusterProfile`)."""
    tj = profile.resolved_trainjob()
    node_selector, tolerations = dict(tj.node_selector), [dict(t) for t in tj.tolerations]
    env = [
        {"name": "HF_HUB_OFFLINE", "value": "1"},
        # One OpenMP thread per rank; torchrun would warn and set it anyway.
        {"name": "OMP_NUM_THREADS", "value": "1"},
    ]
    mounts = [{"name": "shm", "mountPath": "/dev/shm"}]  # NCCL and DataLoader workers share tensors there
    volumes: list[dict[str, Any]] = [{"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": profile.shm_size}}]
    if profile.scratch_size:
        # Model downloads and temp files go to a volume, not the container's writable layer.
        env += [{"name": "PEAGLE_CACHE", "value": f"{SCRATCH_MOUNT}/cache"},
                {"name": "HF_HOME", "value": f"{SCRATCH_MOUNT}/hf"},
                {"name": "TRITON_CACHE_DIR", "value": f"{SCRATCH_MOUNT}/triton"},
                {"name": "TMPDIR", "value": SCRATCH_MOUNT}]
        mounts.append({"name": "scratch", "mountPath": SCRATCH_MOUNT})
        volumes.append({"name": "scratch", "emptyDir": {"sizeLimit": profile.scratch_size}})
    pod: dict[str, Any] = {
        "securityContext": {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
        "containers": [{
            "name": TRAINER_NODE,
            "image": tj.image,
            "command": ["torchrun", "-m", "peagle.train"],
            "env": env,
            "securityContext": {"allowPrivilegeEscalation": False, "runAsNonRoot": True,
                                "capabilities": {"drop": ["ALL"]}, "seccompProfile": {"type": "RuntimeDefault"}},
            "volumeMounts": mounts,
        }],
        "volumes": volumes,
    }
    if node_selector:
        pod["nodeSelector"] = node_selector
    if tolerations:
        pod["tolerations"] = tolerations
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "ClusterTrainingRuntime",
        "metadata": {"name": tj.runtime, "labels": {
            "app.kubernetes.io/name": "peagle", "app.kubernetes.io/component": "trainer",
            "peagle.io/profile": profile.name, "trainer.kubeflow.org/framework": "torch"}},
        "spec": {
            "mlPolicy": {"numNodes": 1, "torch": {}},
            "template": {"spec": {"replicatedJobs": [{
                "name": TRAINER_NODE,
                "template": {
                    "metadata": {"labels": {"trainer.kubeflow.org/trainjob-ancestor-step": "trainer"}},
                    "spec": {"template": {"spec": pod}},
                },
            }]}},
        },
    }
