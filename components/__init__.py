"""The peagle pipeline's KFP v2 lightweight components: thin typed wrappers around the library.

Each module holds one plain Python function (callable directly, e.g. in tests) whose body only
imports and calls ``peagle.pipeline``; :func:`build` turns them into KFP components with the
image the cluster profile names for their role:

=============  ========  =====================================================================
component      image     does (library function)
=============  ========  =====================================================================
init_run       base      validate settings, write <run>/run.json, normalise the target
regenerate     vllm      target rewrites the assistant turns (optional)
prepare        base      tokenise + mask + split; returns one shard assignment per extract worker
extract        vllm      target hidden states of one shard set (ParallelFor fan-out)
gpu_limit      base      num_gpus as text for the train pod's accelerator limit (train_mode=pod)
train          trainer   torchrun in the pod (train_mode=pod)
train_launcher base      the same function for train_mode=trainjob: creates and watches a Kubeflow
                         Trainer TrainJob, holds no GPU, so it needs no multi-GB CUDA image
evaluate       vllm      vLLM-measured acceptance, report, KFP Metrics/HTML; returns the gate verdict
deploy         base      KServe (or Deployment) serving target + draft; or render the manifests
=============  ========  =====================================================================

Heavy data never passes through KFP: the components exchange the run's object-store URI (and
small JSON strings); see ``peagle.pipeline.layout``.
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from . import deploy, evaluate, extract, gpu_limit, init_run, prepare, regenerate, train

MODULES = (init_run, regenerate, prepare, extract, gpu_limit, train, evaluate, deploy)


def build(profile: Any) -> SimpleNamespace:
    """KFP components for ``profile`` (a ``peagle.pipeline.profile.ClusterProfile``), by module name."""
    from kfp import dsl

    images = profile.images.model_dump()
    out = {}
    for module in MODULES:
        name = module.__name__.rsplit(".", 1)[-1]
        out[name] = dsl.component(getattr(module, name), base_image=images[module.IMAGE],
                                  install_kfp_package=profile.install_kfp_package)
    out["train_launcher"] = dsl.component(train.train, base_image=images[train.LAUNCHER_IMAGE],
                                          install_kfp_package=profile.install_kfp_package)
    return SimpleNamespace(**out)
