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
import reprlib
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
    # No setting means "infinite" or "not a number": NaN/inf would pass every bound (NaN compares false)
    # or wait forever, and fail late, far from the key that set it.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False, allow_inf_nan=False)


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


# Limits on user-supplied YAML (run configs, profiles, values files, ``--set`` values). A config is a
# few KB of shallow mappings; these stop an alias bomb or a deep nesting before it costs memory or
# overflows the stack (of the composer here, of pydantic, repr or yaml.safe_dump later).
MAX_YAML_BYTES = 1 << 20
MAX_YAML_DEPTH = 64
MAX_YAML_ALIASES = 1000
MAX_YAML_NODES = 100_000  # values after expanding aliases
MAX_YAML_CHARS = 4 << 20  # characters of all scalars after expanding aliases
MAX_KEY_PARTS = MAX_YAML_DEPTH  # parts of a dotted --set key
# The longest duration or timeout a setting may hold: longer is a typo, and past what some fields take
# (Kubernetes' int64 seconds, protobuf Durations, time.sleep).
MAX_DURATION_S = 366 * 86400

_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxdict, _REPR.maxlist, _REPR.maxtuple, _REPR.maxset = 3, 4, 4, 4, 4
_REPR.maxstring, _REPR.maxlong, _REPR.maxother = 60, 40, 60


def shorten(text: str, limit: int = 80) -> str:
    """``text`` cut to at most ``limit`` characters (``...`` marks the cut)."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def short_repr(value: Any, limit: int = 80) -> str:
    """A repr of ``value`` of at most ``limit`` characters, never built in full (an input may be huge,
    deep or recursive)."""
    try:
        text = _REPR.repr(value)
    except Exception:  # noqa: BLE001 - e.g. an int too long to print; say what it is instead
        text = f"<{type(value).__name__}>"
    return shorten(text, limit)


class _LimitedLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that counts while composing: nesting depth, aliases, and the values and
    scalar characters the document holds once aliases are expanded (an alias counts its target again)."""

    def __init__(self, stream: str, source: str):
        super().__init__(stream)
        self.source = source
        self.depth = 0
        self.aliases = 0
        self.open_anchors: set[str] = set()

    def _limit(self, what: str, event: Any = None) -> ConfigError:
        mark = getattr(event, "start_mark", None) if event is not None else self.get_mark()
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        return ConfigError(f"{self.source}: {what}{where}")

    def fetch_flow_collection_start(self, TokenClass: Any) -> None:
        # Checked while scanning too: the scanner reads ahead of the composer, and its work per '[' or '{'
        # grows with the number of open ones.
        if self.flow_level >= MAX_YAML_DEPTH:
            raise self._limit(f"nested deeper than {MAX_YAML_DEPTH} levels")
        super().fetch_flow_collection_start(TokenClass)

    def compose_node(self, parent: Any, index: Any) -> Any:
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent):
            self.aliases += 1
            if self.aliases > MAX_YAML_ALIASES:
                raise self._limit(f"more than {MAX_YAML_ALIASES} aliases", event)
            if event.anchor in self.open_anchors:
                raise self._limit("an alias refers to a value that contains it", event)
            return super().compose_node(parent, index)
        self.depth += 1
        if self.depth > MAX_YAML_DEPTH:
            raise self._limit(f"nested deeper than {MAX_YAML_DEPTH} levels", event)
        anchor = getattr(event, "anchor", None)
        if anchor is not None:
            self.open_anchors.add(anchor)
        try:
            node = super().compose_node(parent, index)
        finally:
            self.depth -= 1
            self.open_anchors.discard(anchor)
        self._count(node, event)
        return node

    def _count(self, node: Any, event: Any) -> None:
        if isinstance(node, yaml.ScalarNode):
            nodes, chars = 1, len(node.value)
        else:
            children = node.value if isinstance(node, yaml.SequenceNode) else [c for kv in node.value for c in kv]
            nodes = 1 + sum(c.expanded[0] for c in children)
            chars = sum(c.expanded[1] for c in children)
        if nodes > MAX_YAML_NODES:
            raise self._limit(f"more than {MAX_YAML_NODES} values (aliases expanded)", event)
        if chars > MAX_YAML_CHARS:
            raise self._limit(f"more than {MAX_YAML_CHARS} characters of values (aliases expanded)", event)
        node.expanded = (nodes, chars)


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """Why YAML refused the text, with line and column but not the snippet of the text pyyaml quotes."""
    if isinstance(exc, yaml.reader.ReaderError):
        char = exc.character if isinstance(exc.character, int) else None
        return f"{exc.reason} (character #x{char:04x} at position {exc.position})" if char is not None \
            else f"{exc.reason} (at position {exc.position})"
    if isinstance(exc, yaml.MarkedYAMLError):
        mark = exc.problem_mark or exc.context_mark
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        return shorten(" ".join(p for p in (exc.context, exc.problem) if p), 160) + where
    return shorten(str(exc), 160)


def load_yaml(text: str, source: str) -> Any:
    """One YAML document from ``text`` (user input) with safe types and the limits above; raises
    :class:`ConfigError` starting with ``source`` on bad YAML or a limit."""
    if len(text) > MAX_YAML_BYTES:
        raise ConfigError(f"{source}: larger than {MAX_YAML_BYTES} bytes")
    loader = None
    try:
        loader = _LimitedLoader(text, source)  # refuses control characters already
        return loader.get_single_data()
    except ConfigError:
        raise
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: not valid YAML: {_yaml_problem(exc)}") from None
    except Exception as exc:  # noqa: BLE001 - pyyaml's constructors fail on some typed scalars with any error
        raise ConfigError(f"{source}: not valid YAML: a value cannot be read ({type(exc).__name__}: "
                          f"{shorten(str(exc), 100)})") from None
    finally:
        if loader is not None:
            loader.dispose()


def read_text_file(path: str | Path, what: str) -> str:
    """The text of a user-supplied file, at most :data:`MAX_YAML_BYTES`; :class:`ConfigError` naming the
    file (never quoting it) when it is missing, unreadable, too large or not UTF-8 text."""
    try:
        with open(path, "rb") as fh:
            raw = fh.read(MAX_YAML_BYTES + 1)
    except FileNotFoundError:
        raise ConfigError(f"{what} not found: {path}") from None
    except OSError as exc:
        raise ConfigError(f"{what} {path}: cannot be read ({exc.strerror or type(exc).__name__})") from None
    if len(raw) > MAX_YAML_BYTES:
        raise ConfigError(f"{what} {path}: larger than {MAX_YAML_BYTES} bytes")
    nul = raw.find(b"\0")
    if nul >= 0:
        raise ConfigError(f"{what} {path}: not a text file (NUL byte at offset {nul})")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{what} {path}: not UTF-8 text (invalid byte at offset {exc.start})") from None


def load_yaml_mapping(path: str | Path, what: str = "config file") -> dict[str, Any]:
    """A user-supplied YAML file whose top level is a mapping (an empty file: ``{}``), read with
    :func:`read_text_file` and :func:`load_yaml`; errors name the file and never quote it."""
    data = load_yaml(read_text_file(path, what), f"{what} {path}")
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{what} {path}: top level must be a mapping, got {type(data).__name__}")
    return data


def _format_validation_error(err: ValidationError, source: str | None) -> str:
    errors = err.errors()
    lines = []
    for e in errors[:10]:
        key = shorten(".".join(str(p) for p in e["loc"]) or "<root>", 120)
        if e["type"] == "extra_forbidden":
            msg = f"unknown key '{key}'"
        else:
            msg = f"invalid value for '{key}': {shorten(e['msg'], 200)} (got {short_repr(e.get('input'))})"
        lines.append(msg)
    if len(errors) > 10:
        lines.append(f"{len(errors) - 10} more errors")
    where = f" in {source}" if source else ""
    return f"configuration error{where}: " + "; ".join(lines)


def _set_dotted(data: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    if len(parts) > MAX_KEY_PARTS:
        raise ConfigError(f"cannot set '{shorten(dotted)}': more than {MAX_KEY_PARTS} key parts")
    if not all(parts):
        raise ConfigError(f"cannot set '{shorten(dotted)}': empty key part")
    cur = data
    for p in parts[:-1]:
        nxt = cur.setdefault(p, {})
        if not isinstance(nxt, dict):
            raise ConfigError(f"cannot set '{shorten(dotted)}': '{shorten(p)}' is not a section")
        cur = nxt
    cur[parts[-1]] = value


def parse_override(text: str) -> tuple[str, Any]:
    """``section.key=value`` -> (dotted key, YAML-typed value, read by :func:`load_yaml`)."""
    if "=" not in text:
        raise ConfigError(f"override '{shorten(text)}' must look like section.key=value")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(f"override '{shorten(text)}' has an empty key")
    value = load_yaml(raw, f"override '{shorten(key)}'") if raw.strip() else None
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
        loaded = load_yaml_mapping(yaml_path)
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


def add_run_config_args(parser: Any, *, reads: str = "", example: str = "draft.num_layers=2") -> None:
    """``--config FILE`` and ``--set KEY=VALUE`` (repeatable, into ``ns.overrides``): every command's way to the
    run configuration (:func:`build_config` reads them). ``reads`` says which sections the command reads;
    ``example`` is the ``--set`` shown in the help."""
    parser.add_argument("--config", help="YAML run configuration" + (f" ({reads})" if reads else ""))
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help=f"override one setting, e.g. --set {example} (repeatable)")


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
