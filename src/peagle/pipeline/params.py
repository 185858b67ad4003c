"""The run's configuration as the pipeline sees it: typed pipeline parameters + one config YAML.

The dashboard form shows the main knobs as typed pipeline parameters (:class:`PipelineParams`);
everything else is set through the ``config`` parameter, a YAML document with the sections of
:class:`peagle.run_config.RunConfig` (``prepare``, ``extract``, ``train``, ``evaluate``, ...).
``init_run`` resolves both once, validates them with the same pydantic model the CLI uses, and
writes ``<run>/run.json``; later steps read that file.

A key that a typed parameter covers (see :data:`COVERAGE`) may appear in ``config`` only with the
same value: two places disagreeing about one setting is an error, not a silent precedence rule. Such a
parameter takes its bounds from the schema field of its key (:func:`covered_bounds`) and is validated as
that key is, so a bad value is refused naming the parameter wherever the parameters are validated.
Paths the pipeline owns (``target.path``, ``train.data``, ``train.output``, ``work_dir``,
``evaluate.draft/out/hidden_states``) are set by the steps and may not be configured.

This module is the one definition of the pipeline's parameters. :class:`PipelineParams` and
:class:`RunPlacement` give every parameter's name, type, default and description; from them derive
the pipeline function's signature and parameter descriptions (:func:`pipeline_signature`,
:func:`pipeline_docstring`), the ``init_run`` component's source (:func:`init_run_component_source`,
written by ``peagle pipeline compile``), the embedded run's arguments (validated as
``PipelineParams``), and both directions of the parameter <-> config-key mapping (:data:`COVERAGE`).
``tests/unit/pipeline/test_pipeline_params.py`` fails if any of them drifts.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from functools import lru_cache
from typing import Annotated, Any, Callable, Literal, get_args, get_origin

import yaml
from pydantic import ConfigDict, Field, TypeAdapter, ValidationError, field_validator
from pydantic.fields import FieldInfo
from pydantic_core import PydanticCustomError

from ..config import ConfigError, StrictModel, build_config, load_yaml, parse_override, shorten, short_repr
from ..deploy.values import RULES
from ..run_config import RunConfig, check_trainer_order
from .layout import _RUN_NAME

OBJECT_NAME = RULES["objectName"]  # the chart's and `peagle deploy --name`'s rule
SECRET_NAME = RULES["dnsSubdomain"]  # a data connection is a Secret
PIPELINE_OWNED = ("target.path", "train.data", "train.output", "work_dir",
                  "evaluate.draft", "evaluate.out", "evaluate.hidden_states")


@dataclass(frozen=True)
class Covered:
    """A config key a typed parameter sets, with the conversions both ways (``peagle run`` maps a
    user's config key back to the parameter)."""

    param: str
    key: str
    to_config: Callable[[Any], Any]
    to_param: Callable[[Any], Any]


def _sources(v: str) -> list[str]:
    return [s.strip() for s in v.split(",") if s.strip()]


COVERAGE: tuple[Covered, ...] = (
    Covered("data_source", "prepare.sources", _sources, ",".join),
    Covered("data_source", "regenerate.sources", _sources, ",".join),
    Covered("num_samples", "prepare.max_samples", lambda v: v or None, lambda v: v or 0),
    Covered("max_length", "prepare.max_length", int, int),
    Covered("num_speculative_tokens", "draft.num_depths", int, int),
    Covered("draft_layers", "draft.num_layers", int, int),
    Covered("train_epochs", "train.epochs", int, int),
    Covered("train_max_steps", "train.max_steps", lambda v: v or None, lambda v: v or 0),
    Covered("min_acceptance_length", "evaluate.min_acceptance_length", lambda v: v or None, lambda v: v or 0.0),
)
COVERED_KEYS = tuple(c.key for c in COVERAGE)


_LOWER, _UPPER = ("gt", "ge"), ("lt", "le")


def schema_field(key: str) -> FieldInfo:
    """The :class:`RunConfig` field of a dotted config key (``train.epochs``)."""
    model: Any = RunConfig
    for part in key.split("."):
        field = model.model_fields[part]
        model = field.annotation
    return field


def _schema_bounds(key: str) -> dict[str, Any]:
    return {b: getattr(m, b) for m in schema_field(key).metadata for b in (*_LOWER, *_UPPER)
            if getattr(m, b, None) is not None}


def covered_bounds(param: str) -> dict[str, Any]:
    """The bounds (``ge``, ``le``, ...) of the config keys a typed parameter sets: the schema is the one place
    they are written (the tightest of each where the parameter sets several keys). Where the parameter's 0
    leaves its keys unset (``num_samples=0``: all), the lower bound is that 0; :class:`PipelineParams` checks
    each value as its keys are checked besides (``min_acceptance_length=0.5`` is refused)."""
    covered = [c for c in COVERAGE if c.param == param]
    out: dict[str, Any] = {}
    for c in covered:
        for b, v in _schema_bounds(c.key).items():
            out[b] = v if b not in out else (max if b in _LOWER else min)(out[b], v)
    if any(c.to_config(0) is None for c in covered) and any(b in out for b in _LOWER):
        out = {b: v for b, v in out.items() if b in _UPPER} | {"ge": 0}
    return out


@lru_cache(maxsize=None)
def _key_adapter(key: str) -> TypeAdapter:
    """Validates one value as the config key ``key`` is validated (its type and bounds; no NaN or inf)."""
    f = schema_field(key)
    kind = Annotated[(f.annotation, *f.metadata)] if f.metadata else f.annotation
    return TypeAdapter(kind, config=ConfigDict(allow_inf_nan=False))


class PipelineParams(StrictModel):
    """The typed pipeline parameters that shape a run (what the dashboard's run form shows)."""

    target: str = Field(..., description="target: s3:// prefix of a Hugging Face directory, a local directory "
                        "or .gguf file, or 'smollm2' (the embedded SmolLM2-135M-Instruct)")
    data_source: str = Field("sharegpt", description="comma-separated prepare sources (files, hf:<id>, 'sharegpt')")
    num_samples: int = Field(5000, **covered_bounds("num_samples"),
                             description="training rows to prepare (0: all); regeneration makes as many "
                             "conversations unless config sets regenerate.max_conversations")
    max_length: int = Field(2048, **covered_bounds("max_length"), description="tokens per training row")
    regenerate: bool = Field(False, description="let the target rewrite the assistant turns first (vLLM)")
    num_speculative_tokens: int = Field(4, **covered_bounds("num_speculative_tokens"),
                                        description="K: parallel draft depths trained and served")
    draft_layers: int = Field(1, **covered_bounds("draft_layers"), description="decoder layers of the draft")
    extract_shards: int = Field(2, ge=1, le=256, description="parallel extraction workers (ParallelFor fan-out)")
    train_mode: Literal["pod", "trainjob"] = Field("pod", description="'pod': torchrun in the step's pod; "
                                                  "'trainjob': a Kubeflow Trainer TrainJob (multi-node)")
    num_gpus: int = Field(1, ge=1, le=64, description="GPUs (and torchrun processes) per training node")
    num_nodes: int = Field(1, ge=1, le=256, description="training nodes (train_mode=trainjob)")
    train_epochs: int = Field(1, **covered_bounds("train_epochs"), description="passes over the training data")
    train_max_steps: int = Field(0, **covered_bounds("train_max_steps"),
                                 description="stop after this many optimiser steps (0: all epochs)")
    min_acceptance_length: float = Field(1.5, **covered_bounds("min_acceptance_length"),
                                         description="deploy only if the vLLM-measured acceptance "
                                         "length reaches this (0: no gate)")
    # Checked here, before hours of training, although only the deploy step uses them.
    deploy_mode: Literal["kserve", "deployment", "render", "none"] = Field(
        "kserve", description="how to serve: 'kserve' (InferenceService), 'deployment' (a plain Deployment), "
        "'render' (write the manifests only) or 'none'")
    deploy_name: str = Field("peagle", pattern=OBJECT_NAME.pattern, max_length=OBJECT_NAME.max_length,
                             description="InferenceService / Deployment name (DNS-1035 label)")

    @field_validator(*dict.fromkeys(c.param for c in COVERAGE))
    @classmethod
    def _valid_for_its_config_keys(cls, value: Any, info) -> Any:
        # Checked here, not only once merged into the run's config, so that the error names the parameter.
        for c in COVERAGE:
            if c.param == info.field_name:
                try:
                    _key_adapter(c.key).validate_python(c.to_config(value))
                except ValidationError as exc:
                    raise PydanticCustomError("config_key", "{msg} (config key {key})",
                                              {"msg": exc.errors()[0]["msg"], "key": c.key}) from None
        return value


class RunPlacement(StrictModel):
    """The pipeline parameters that place a run (storage, name) and carry the rest of its settings."""

    data_connection: str = Field("aws-connection-peagle", pattern=SECRET_NAME.pattern,
                                 max_length=SECRET_NAME.max_length, description="OpenShift AI data connection "
                                 "(Secret) with the object store's endpoint, bucket and credentials")
    output_root: str = Field("s3:///peagle/runs", description="where runs are written: s3://bucket/prefix "
                             "(s3:///prefix: the data connection's bucket) or a directory")
    run_name: str = Field("", description="the run's directory under output_root (default: the pipeline job "
                          "id); rerunning a name reuses its finished stages")
    config: str = Field("", description="YAML of further settings by section (prepare, extract, train, "
                        "evaluate, ...), as `peagle config show` prints them")


PIPELINE_MODELS = (PipelineParams, RunPlacement)




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
    data = load_yaml(text, "pipeline parameter 'config'")
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"pipeline parameter 'config' must be a YAML mapping of sections, got {type(data).__name__}")
    return data


def config_with_params(params: StrictModel, config_text: str, owned: tuple[str, ...], coverage,
                       owner: str) -> RunConfig:
    """The config YAML with the typed parameters merged in, validated. A key in ``owned`` (``owner`` says
    who sets it) or a key a parameter covers set to another value than the parameter's is an error naming it."""
    flat = flatten(parse_config_text(config_text))
    for key in owned:
        if key in flat or any(k.startswith(key + ".") for k in flat):
            raise ConfigError(f"config sets '{key}', which {owner}; remove it")
    for c in coverage:
        value = getattr(params, c.param)
        wanted = c.to_config(value)
        if c.key in flat and flat[c.key] != wanted:
            raise ConfigError(f"config sets '{c.key}' to {flat[c.key]!r} but pipeline parameter '{c.param}' "
                              f"({value!r}) covers it; set the parameter instead")
        flat[c.key] = wanted
    try:
        return build_config(RunConfig, values=flat)
    except ConfigError as exc:
        raise ConfigError(f"pipeline parameter 'config': {exc}") from None


def resolve_run(params: PipelineParams, config_text: str, run_uri: str, *,
                trainer_beside_extract: bool | None = None) -> PipelineRun:
    """Merge the typed parameters into the config YAML and validate everything; see the module docstring.
    ``trainer_beside_extract``: the cluster profile's, which the settings must suit
    (:func:`~peagle.run_config.check_trainer_order`; None: not known here, not checked)."""
    cfg = config_with_params(params, config_text, PIPELINE_OWNED, COVERAGE, "the pipeline sets itself (run layout)")
    if trainer_beside_extract is not None:
        check_trainer_order(cfg, trainer_beside_extract=trainer_beside_extract, runner="this pipeline")
    if params.train_mode == "pod" and params.num_nodes != 1:
        raise ConfigError(f"num_nodes={params.num_nodes} needs train_mode=trainjob (a pod is one node)")
    world = params.num_gpus * params.num_nodes
    if cfg.train.global_batch_rows % world:
        raise ConfigError(f"train.global_batch_rows={cfg.train.global_batch_rows} is not divisible by the "
                          f"{world} training processes (num_gpus x num_nodes)")
    return PipelineRun(run_uri=run_uri, params=params, config=cfg)


def parameter_types(models: tuple[type[StrictModel], ...] = PIPELINE_MODELS) -> dict[str, type]:
    """Every pipeline parameter's name -> its KFP Python type (str, int, float or bool)."""
    return {n: _kfp_type(f.annotation) for model in models for n, f in model.model_fields.items()}


def parse_argument(text: str, types: dict[str, type] | None = None) -> tuple[str, Any]:
    """``NAME=VALUE`` of ``pipeline submit --param``: the value YAML-typed, except that a string parameter
    (of ``types``, default the default pipeline's :func:`parameter_types`) keeps the text as typed unless it
    is a YAML string (``run_name=2024`` is the name "2024", and ``config=train: {lr: 1}`` the YAML text)."""
    key, sep, raw = text.partition("=")
    if sep and (parameter_types() if types is None else types).get(key.strip()) is str:
        try:
            value = parse_override(text)[1]
        except ConfigError:
            value = None
        return key.strip(), value if isinstance(value, str) else raw.strip()
    return parse_override(text)


def _validated(model: type[StrictModel], data: dict[str, Any]) -> StrictModel:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        errors = exc.errors()
        lines = []
        for e in errors[:5]:
            got = "" if e["type"] == "missing" else f" (got {short_repr(e.get('input'))})"
            name = shorten(".".join(str(p) for p in e["loc"]) or "?", 60)
            lines.append(f"pipeline parameter '{name}': {shorten(e['msg'], 200)}{got}")
        more = f"; {len(errors) - 5} more errors" if len(errors) > 5 else ""
        raise ConfigError("; ".join(lines) + more) from None


def check_arguments(args: dict[str, Any], *, trainer_beside_extract: bool | None = None) -> dict[str, Any]:
    """The arguments of a submission (pipeline parameter -> value), validated here as the run validates
    them (``init_run``: the typed parameters, the placement, the ``config`` YAML with the parameters merged
    in, :func:`resolve_run` for a profile with ``trainer_beside_extract``), before anything is sent. Returns them as the parameters' types
    (``num_gpus: 2.0`` -> 2). ConfigError names the parameter (or the config key) that is wrong."""
    known = parameter_types()
    unknown = [k for k in args if k not in known]
    if unknown:
        raise ConfigError(f"'{shorten(str(unknown[0]), 60)}' is not a pipeline parameter; the parameters are "
                          + ", ".join(known))
    params = _validated(PipelineParams, {k: v for k, v in args.items() if k in PipelineParams.model_fields})
    placement = _validated(RunPlacement, {k: v for k, v in args.items() if k in RunPlacement.model_fields})
    if placement.run_name and not _RUN_NAME.match(placement.run_name):
        raise ConfigError(f"pipeline parameter 'run_name': {short_repr(placement.run_name)} must be 1-128 "
                          "characters of letters, digits, '.', '_' or '-'")
    # the run's place does not change what is valid
    resolve_run(params, placement.config, "/run", trainer_beside_extract=trainer_beside_extract)
    return {k: getattr(params if k in PipelineParams.model_fields else placement, k) for k in args}


def config_text(data: dict[str, Any]) -> str:
    """A config mapping as the YAML text the ``config`` parameter takes."""
    return yaml.safe_dump(data, sort_keys=False) if data else ""


# ----------------------------------------------------------------------------------------------
# What derives from the definition above: the pipeline signature and the init_run component.


def _kfp_type(annotation: Any) -> type:
    """The KFP parameter type of a field: its Python type; a Literal choice is its values' type."""
    if get_origin(annotation) is Literal:
        return type(get_args(annotation)[0])
    if annotation not in (str, int, float, bool):
        raise TypeError(f"pipeline parameters must be str, int, float, bool or a Literal of them, got {annotation}")
    return annotation


def pipeline_parameters(models: tuple[type[StrictModel], ...] = PIPELINE_MODELS) -> list[inspect.Parameter]:
    """Every pipeline parameter of ``models``, in order (default: the typed run parameters, then the run's
    placement)."""
    out = []
    for model in models:
        for name, f in model.model_fields.items():
            default = inspect.Parameter.empty if f.is_required() else f.default
            out.append(inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=default,
                                         annotation=_kfp_type(f.annotation)))
    return out


def pipeline_signature(models: tuple[type[StrictModel], ...] = PIPELINE_MODELS) -> inspect.Signature:
    return inspect.Signature(pipeline_parameters(models))


def pipeline_docstring(summary: str, models: tuple[type[StrictModel], ...] = PIPELINE_MODELS) -> str:
    """``summary`` plus an ``Args:`` section (KFP shows these descriptions for the run form's fields)."""
    lines = [summary, "", "Args:"]
    for model in models:
        for name, f in model.model_fields.items():
            lines.append(f"    {name}: {f.description}")
    return "\n".join(lines)


def init_run_parameters() -> list[str]:
    """The typed parameters ``init_run`` takes (and passes to ``peagle.pipeline.steps.init_run``)."""
    return list(PipelineParams.model_fields)


INIT_RUN_HEADER = '''"""init_run: resolve and validate the run's settings, write <run>/run.json, normalise the target.

Generated from peagle.pipeline.params (PipelineParams) by `peagle pipeline compile`; do not edit.
"""
from kfp.dsl import Model, Output

IMAGE = "base"
'''


def _wrapped(head: str, items: list[str], tail: str, indent: int, width: int = 116) -> list[str]:
    """``head + ", ".join(items) + tail`` packed into lines of at most ``width``, never splitting an item."""
    lines, line = [], head
    for i, item in enumerate(items):
        piece = item + (", " if i < len(items) - 1 else tail)
        if len(line) + len(piece.rstrip()) > width and line.strip():
            lines.append(line.rstrip())
            line = " " * indent
        line += piece
    return lines + [line.rstrip()]


def init_run_component_source() -> str:
    """The text of ``components/init_run.py``: KFP builds a lightweight component from a function's
    source, so the typed parameters are written out as a literal signature, generated here."""
    typed = [(n, _kfp_type(PipelineParams.model_fields[n].annotation).__name__) for n in init_run_parameters()]
    sig = [f"{n}: str" for n in ("output_root", "run_name", "job_id", "config")] + [f"{n}: {t}" for n, t in typed]
    # data_connection: the Secret's name, for init_run's check of its keys (optional: callers outside KFP);
    # train_beside_extract: the profile's (a constant of the compiled pipeline), which the settings must suit
    sig += ["target_model: Output[Model]", 'data_connection: str = ""', "train_beside_extract: bool = False"]
    call = [f"{n}={n}" for n in ("output_root", "run_name", "job_id", "config")] + [f"{n}={n}" for n, _ in typed]
    call += ["data_connection=data_connection", "train_beside_extract=train_beside_extract"]
    lines = [INIT_RUN_HEADER, ""]
    lines += _wrapped("def init_run(", sig, ") -> str:", 13)
    lines += ['    """Returns the run URI (``<output_root>/<run_name or job_id>``) every later step works on;',
              '    ``target_model``: lineage pointer to the normalised target (``peagle.pipeline.lineage``)."""',
              "    from peagle.pipeline.lineage import record",
              "    from peagle.pipeline.steps import init_run as step",
              ""]
    lines += _wrapped("    run_uri = step(", call, ")", 19)
    lines += ['    record(target_model, run_uri, "init_run")', "    return run_uri", ""]
    return "\n".join(lines)
