"""The run's configuration as the pipeline sees it: typed pipeline parameters + one config YAML.

The dashboard form shows the main knobs as typed pipeline parameters (:class:`PipelineParams`);
everything else is set through the ``config`` parameter, a YAML document with the sections of
:class:`peagle.run_config.RunConfig` (``prepare``, ``extract``, ``train``, ``evaluate``, ...).
``init_run`` resolves both once, validates them with the same pydantic model the CLI uses, and
writes ``<run>/run.json``; later steps read that file.

A key that a typed parameter covers (see :data:`COVERED`) may appear in ``config`` only with the
same value: two places disagreeing about one setting is an error, not a silent precedence rule.
Paths the pipeline owns (``target.path``, ``train.data``, ``train.output``, ``work_dir``,
``evaluate.draft/out/hidden_states``) are set by the steps and may not be configured.
"""
from __future__ import annotations

from typing import Any, Literal

import yaml
from pydantic import Field

from ..config import ConfigError, StrictModel, build_config
from ..run_config import RunConfig

PIPELINE_OWNED = ("target.path", "train.data", "train.output", "work_dir",
                  "evaluate.draft", "evaluate.out", "evaluate.hidden_states")


class PipelineParams(StrictModel):
    """The typed pipeline parameters that shape a run (what the dashboard's run form shows)."""

    target: str = Field(..., description="target: s3:// prefix of a Hugging Face directory, a local directory "
                        "or .gguf file, or 'smollm2' (the embedded SmolLM2-135M-Instruct)")
    data_source: str = Field("sharegpt", description="comma-separated prepare sources (files, hf:<id>, 'sharegpt')")
    num_samples: int = Field(5000, ge=0, description="training rows to prepare (0: all); also caps regeneration")
    max_length: int = Field(2048, ge=8, description="tokens per training row")
    regenerate: bool = Field(False, description="let the target rewrite the assistant turns first (vLLM)")
    num_speculative_tokens: int = Field(4, ge=1, le=16, description="K: parallel draft depths trained and served")
    draft_layers: int = Field(1, ge=1, le=64, description="decoder layers of the draft")
    extract_shards: int = Field(2, ge=1, le=256, description="parallel extraction workers (ParallelFor fan-out)")
    train_mode: Literal["pod", "trainjob"] = Field("pod", description="'pod': torchrun in the step's pod; "
                                                  "'trainjob': a Kubeflow Trainer TrainJob (multi-node)")
    num_gpus: int = Field(1, ge=1, le=64, description="GPUs (and torchrun processes) per training node")
    num_nodes: int = Field(1, ge=1, le=256, description="training nodes (train_mode=trainjob)")
    train_epochs: int = Field(1, ge=1, description="passes over the training data")
    train_max_steps: int = Field(0, ge=0, description="stop after this many optimiser steps (0: all epochs)")
    min_acceptance_length: float = Field(1.5, ge=0.0, description="deploy only if the vLLM-measured acceptance "
                                         "length reaches this (0: no gate)")
    # Checked here, before hours of training, although only the deploy step uses them.
    deploy_mode: Literal["kserve", "deployment", "render", "none"] = Field("kserve", description="how to serve")
    deploy_name: str = Field("peagle", pattern=r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$",
                             description="InferenceService / Deployment name (DNS-1035 label)")


# typed parameter -> the config keys it sets (dotted), with a converter
COVERED: dict[str, list[tuple[str, Any]]] = {
    "data_source": [("prepare.sources", lambda v: [s.strip() for s in v.split(",") if s.strip()]),
                    ("regenerate.sources", lambda v: [s.strip() for s in v.split(",") if s.strip()])],
    "num_samples": [("prepare.max_samples", lambda v: v or None),
                    ("regenerate.max_conversations", lambda v: v or None)],
    "max_length": [("prepare.max_length", int)],
    "num_speculative_tokens": [("draft.num_depths", int)],
    "draft_layers": [("draft.num_layers", int)],
    "train_epochs": [("train.epochs", int)],
    "train_max_steps": [("train.max_steps", lambda v: v or None)],
    "min_acceptance_length": [("evaluate.min_acceptance_length", lambda v: v or None)],
}


class PipelineRun(StrictModel):
    """Everything the steps of one run need (``<run>/run.json``)."""

    run_uri: str
    params: PipelineParams
    config: RunConfig


def flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in data.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def parse_config_text(text: str) -> dict[str, Any]:
    """The ``config`` parameter: YAML mapping of sections (empty text: no settings)."""
    if not text or not text.strip():
        return {}
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"pipeline parameter 'config' is not valid YAML: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"pipeline parameter 'config' must be a YAML mapping of sections, got {type(data).__name__}")
    return data


def resolve_run(params: PipelineParams, config_text: str, run_uri: str) -> PipelineRun:
    """Merge the typed parameters into the config YAML and validate everything; see the module docstring."""
    flat = flatten(parse_config_text(config_text))
    for key in PIPELINE_OWNED:
        if key in flat or any(k.startswith(key + ".") for k in flat):
            raise ConfigError(f"config sets '{key}', which the pipeline sets itself (run layout); remove it")
    for param, targets in COVERED.items():
        value = getattr(params, param)
        for key, convert in targets:
            wanted = convert(value)
            if key in flat and flat[key] != wanted:
                raise ConfigError(f"config sets '{key}' to {flat[key]!r} but pipeline parameter '{param}' "
                                  f"({value!r}) covers it; set the parameter instead")
            flat[key] = wanted
    cfg = build_config(RunConfig, values=flat)
    if params.train_mode == "pod" and params.num_nodes != 1:
        raise ConfigError(f"num_nodes={params.num_nodes} needs train_mode=trainjob (a pod is one node)")
    world = params.num_gpus * params.num_nodes
    if cfg.train.global_batch_rows % world:
        raise ConfigError(f"train.global_batch_rows={cfg.train.global_batch_rows} is not divisible by the "
                          f"{world} training processes (num_gpus x num_nodes)")
    return PipelineRun(run_uri=run_uri, params=params, config=cfg)


def config_text(data: dict[str, Any]) -> str:
    """A config mapping as the YAML text the ``config`` parameter takes."""
    return yaml.safe_dump(data, sort_keys=False) if data else ""
