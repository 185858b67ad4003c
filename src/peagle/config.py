"""Run settings: one typed schema, the single source of truth.

YAML files and CLI flags derive from the pydantic models, so they cannot drift apart; the
pipeline's ``config`` parameter is validated with the same models. The pipeline's typed parameters
are defined in :mod:`peagle.pipeline.params` (``PipelineParams``), which maps each to the key of
this schema it sets. Unknown keys are errors that name the key. This module holds the
machinery and the model-level sections; each stage defines its own section next to its code, and
:mod:`peagle.run_config` assembles them into the one ``RunConfig``.

Precedence: explicit CLI flag > ``--set section.key=value`` override > YAML file > default.
"""
from __future__ import annotations

import argparse
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from .errors import PeagleError


class ConfigError(PeagleError, ValueError):
    """A configuration problem, with the offending key (and file, when there is one) in the message."""


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False)


class TargetSettings(StrictModel):
    """The model being accelerated."""

    path: str = Field("", description="local Hugging Face directory or .gguf file of the target")
    dtype: Literal["bfloat16", "float16", "float32"] = Field(
        "bfloat16", description="dtype of the normalised target directory"
    )
    trust_remote_code: bool = Field(
        False, description="allow custom modelling code shipped with the target (off: only built-in architectures)"
    )


class DraftSettings(StrictModel):
    """Shape of the P-EAGLE draft; everything vLLM needs is derived from this plus the target config."""

    arch: Literal["qwen3", "llama"] = Field("qwen3", description="decoder layer type of the draft")
    num_layers: int = Field(1, ge=1, le=64, description="number of draft decoder layers")
    num_depths: int = Field(4, ge=1, le=16, description="K: parallel draft positions trained and served")
    draft_vocab_size: int | None = Field(
        None, ge=1, description="rows of the draft lm_head (pruned vocabulary); default: the target vocabulary"
    )
    mask_token_id: int | None = Field(
        None, ge=0, description="token id placed in every depth>=1 slot; default: resolved from the tokenizer"
    )
    aux_layer_ids: list[int] | None = Field(
        None, description="target layers feeding fc (exactly 3); default [2, n//2, n-3]"
    )
    norm_before_residual: bool = Field(
        False, description="layer 0 takes its residual from the normed feature half"
    )
    norm_before_fc: bool = Field(False, description="RMSNorm over the concatenated aux features before fc")
    sliding_window: int | None = Field(
        None, ge=1, description="sliding-window size for draft layers not listed in full_attention_layers"
    )
    full_attention_layers: list[int] = Field(
        default_factory=list, description="draft layers that use full attention when sliding_window is set"
    )
    hidden_act: Literal["silu"] = Field("silu", description="MLP activation")
    init_seed: int = Field(0, description="seed for the random parts of the initial weights")
    init_from_target_layer: bool = Field(
        False, description="start every draft decoder layer from the target's top layer where shapes allow "
        "(attention, MLP and norms; layer 0's q/k/v take the target's on the feature half, zeros on the embedding "
        "half); default: random")

    @field_validator("aux_layer_ids")
    @classmethod
    def _three_aux_layers(cls, v: list[int] | None) -> list[int] | None:
        # vLLM's Llama P-EAGLE path assumes 3 aux layers unless told otherwise; we always use 3.
        if v is not None:
            if len(v) != 3:
                raise ValueError(f"exactly 3 aux layer ids are required, got {len(v)}: {v}")
            if any(i < 0 for i in v) or sorted(set(v)) != list(v):
                raise ValueError(f"aux layer ids must be distinct, non-negative and ascending, got {v}")
        return v


# --------------------------------------------------------------------------------------------
# Loading and overriding


def _format_validation_error(err: ValidationError, source: str | None) -> str:
    lines = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"]) or "<root>"
        if e["type"] == "extra_forbidden":
            msg = f"unknown key '{key}'"
        else:
            msg = f"invalid value for '{key}': {e['msg']} (got {e.get('input')!r})"
        lines.append(msg)
    where = f" in {source}" if source else ""
    return f"configuration error{where}: " + "; ".join(lines)


def _set_dotted(data: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    cur = data
    for p in parts[:-1]:
        nxt = cur.setdefault(p, {})
        if not isinstance(nxt, dict):
            raise ConfigError(f"cannot set '{dotted}': '{p}' is not a section")
        cur = nxt
    cur[parts[-1]] = value


def parse_override(text: str) -> tuple[str, Any]:
    """``section.key=value`` -> (dotted key, YAML-typed value)."""
    if "=" not in text:
        raise ConfigError(f"override '{text}' must look like section.key=value")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(f"override '{text}' has an empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as exc:
        raise ConfigError(f"override '{text}': value is not valid YAML: {exc}") from exc
    return key, value


def build_config(
    model: type[StrictModel],
    yaml_path: str | Path | None = None,
    overrides: list[str] | None = None,
    values: dict[str, Any] | None = None,
    own_sections_only: bool = False,
) -> StrictModel:
    """Merge YAML file, ``key=value`` overrides and already-typed ``values`` (dotted keys) and validate.

    ``own_sections_only``: read only the YAML's top-level keys ``model`` has (a stage entry point
    reading a full run configuration, which carries every stage's section); overrides stay strict."""
    data: dict[str, Any] = {}
    source = None
    if yaml_path is not None:
        source = str(yaml_path)
        try:
            loaded = yaml.safe_load(Path(yaml_path).read_text())
        except FileNotFoundError as exc:
            raise ConfigError(f"config file not found: {yaml_path}") from exc
        except yaml.YAMLError as exc:
            raise ConfigError(f"{yaml_path}: not valid YAML: {exc}") from exc
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"{yaml_path}: top level must be a mapping, got {type(loaded).__name__}")
        data = {k: v for k, v in loaded.items() if k in model.model_fields} if own_sections_only else loaded
    for ov in overrides or []:
        k, v = parse_override(ov)
        _set_dotted(data, k, v)
        source = source or "overrides"
    for k, v in (values or {}).items():
        _set_dotted(data, k, v)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_format_validation_error(exc, source)) from None


# --------------------------------------------------------------------------------------------
# CLI flags derived from the schema


def _flag_type(annotation: Any) -> tuple[Any, bool, Any]:
    """(argparse type, is_list, choices) for a field annotation."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        non_none = [a for a in args if a is not type(None)]
        if len(non_none) == 1:
            return _flag_type(non_none[0])
    if origin is list:
        inner, _, _ = _flag_type(args[0])
        return inner, True, None
    if origin is Literal:
        return type(args[0]), False, list(args)
    return annotation, False, None


def add_flags(parser: argparse.ArgumentParser, model: type[StrictModel], section: str, *,
              group: Any = None, prefix: str = "") -> None:
    """Add one ``--flag`` per scalar field of ``model``; values land in ``section.field``. A nested
    section (``train.stream``) gets prefixed flags (``--stream-window-bytes``) in the same group."""
    group = group or parser.add_argument_group(f"{section} settings")
    for name, field in model.model_fields.items():
        if isinstance(field.annotation, type) and issubclass(field.annotation, StrictModel):
            add_flags(parser, field.annotation, section, group=group, prefix=f"{prefix}{name}.")
            continue
        typ, is_list, choices = _flag_type(field.annotation)
        flag = "--" + (prefix + name).replace("_", "-").replace(".", "-")
        dest = f"cfg__{section}__{prefix}{name}"
        help_text = field.description or ""
        if typ is bool:
            group.add_argument(flag, dest=dest, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        elif is_list:
            group.add_argument(flag, dest=dest, type=typ, nargs="+", default=None, metavar=name.upper(), help=help_text)
        else:
            group.add_argument(flag, dest=dest, type=typ, choices=choices, default=None,
                               metavar=None if choices else name.upper(), help=help_text)


def flag_values(ns: argparse.Namespace) -> dict[str, Any]:
    """Dotted-key values of the flags the user actually gave (see :func:`add_flags`)."""
    out = {}
    for k, v in vars(ns).items():
        if k.startswith("cfg__") and v is not None:
            _, section, name = k.split("__", 2)
            out[f"{section}.{name}"] = v
    return out
