"""The refresh pipeline's parameters: typed parameters + one config YAML, as for the default pipeline.

The run form shows the traffic window and the gate's bars as typed parameters (:class:`RefreshParams`);
every other setting comes through the ``config`` parameter, the sections of
:class:`peagle.run_config.RunConfig` (the serving draft's own run's ``draft``/``train``/``extract``
sections, plus ``refresh`` and ``gate``). The rules are the default pipeline's
(:mod:`peagle.pipeline.params`): a parameter that covers a config key (:data:`REFRESH_COVERAGE`)
takes that key's default, bounds and description from the schema, may appear in ``config`` only with
the same value, and is validated as that key is, so an error names the parameter. The run's placement
(``data_connection``, ``output_root``, ``run_name``, ``config``) is the default pipeline's
:class:`~peagle.pipeline.params.RunPlacement`.

The first step (``trigger``) resolves both once and writes ``<refresh>/run.json`` (:class:`RefreshRun`);
later steps read it. ``rollout_routing`` (``none``: no rollout) and the stable deployment's
``deploy_name``/``deploy_namespace``/``deploy_mode`` are the last step's (``rollout``).

The rollout step's deadline is the cluster profile's (``steps.rollout.timeout_s``), compiled into the
pipeline, while the rollout settings arrive with the run: they meet in :func:`resolve_refresh`, which refuses
settings the deadline cannot hold (:func:`peagle.pipeline.profile.check_rollout_deadline`) -- at submission,
where the profile is known, and in the trigger step, before any GPU step, from :data:`ROLLOUT_DEADLINE_ENV`,
which the compiled pipeline sets on the trigger's pod.
"""
from __future__ import annotations

import os
from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator
from pydantic_core import PydanticCustomError

from ..config import ConfigError, StrictModel
from ..run_config import RunConfig
from .params import (OBJECT_NAME, PIPELINE_OWNED, Covered, RunPlacement, _key_adapter, _schema_bounds, _validated,
                     config_with_params, parameter_types, schema_field)
from .profile import check_rollout_deadline


def _same(v: Any) -> Any:
    return v


REFRESH_COVERAGE: tuple[Covered, ...] = (
    Covered("traffic", "refresh.traffic", _same, _same),
    Covered("base_data", "refresh.base_data", _same, _same),
    Covered("since", "refresh.since", _same, _same),
    Covered("until", "refresh.until", _same, _same),
    Covered("replay_fraction", "refresh.replay_fraction", float, float),
    Covered("gate_margin", "gate.margin", float, float),
    Covered("gate_tolerance", "gate.tolerance", float, float),
    Covered("rollout_canary_percent", "rollout.canary_percent", int, int),
    Covered("rollout_min_requests", "rollout.min_requests", int, int),
    Covered("rollout_window_s", "rollout.window_s", float, float),
)
ROLLOUT_ROUTINGS = ("none", "kserve-canary", "route", "httproute")
# The refresh sets these itself: the warm start is the serving_draft parameter.
REFRESH_OWNED = (*PIPELINE_OWNED, "train.init_from")
# Set by the compiled refresh pipeline on its trigger step's pod: the rollout step's deadline in seconds.
ROLLOUT_DEADLINE_ENV = "PEAGLE_ROLLOUT_DEADLINE_S"


def _covering(key: str, **overrides: Any) -> Any:
    """A parameter field for config key ``key``: the schema's default, bounds and description."""
    f = schema_field(key)
    kw: dict[str, Any] = {"default": f.default, **_schema_bounds(key), "description": f"{f.description} ({key})"}
    return Field(**{**kw, **overrides})


class RefreshParams(StrictModel):
    """The typed parameters of a refresh run (what the dashboard's run form shows)."""

    target: str = Field(..., description="the served target: the published prefix the serving draft's run "
                        "normalised (<run>/models/target) or a local directory; traffic captured from another "
                        "target (fingerprint) is dropped and counted")
    serving_draft: str = Field(..., description="the draft now served: a published prefix (<run>/models/draft) or a "
                               "local directory; the candidate starts from its weights and is gated against it")
    traffic: str = _covering("refresh.traffic", default=...)
    base_data: str = _covering("refresh.base_data")
    since: str = _covering("refresh.since")
    until: str = _covering("refresh.until")
    replay_fraction: float = _covering("refresh.replay_fraction")
    gate_margin: float = _covering("gate.margin")
    gate_tolerance: float = _covering("gate.tolerance")
    rollout_routing: Literal["none", "kserve-canary", "route", "httproute"] = Field(
        "none", description="roll a candidate that passed the gate out beside the stable deployment and promote or "
        "roll it back on live acceptance, splitting traffic by: 'route' (OpenShift Route weights), 'kserve-canary' "
        "(KServe >= 0.20 with its Gateway API ingress) or 'httproute' (Gateway API weights), which becomes "
        "rollout.routing; 'none': no rollout")
    rollout_canary_percent: int = _covering("rollout.canary_percent")
    rollout_min_requests: int = _covering("rollout.min_requests")
    rollout_window_s: float = _covering("rollout.window_s")
    deploy_name: str = Field("peagle", pattern=OBJECT_NAME.pattern, max_length=OBJECT_NAME.max_length,
                             description="the stable deployment the rollout replaces the draft of: its "
                             "InferenceService / Deployment name (the default pipeline's deploy_name)")
    deploy_namespace: str = Field("", pattern=r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?)?$", max_length=63,
                                  description="its namespace (\"\": the pipeline's own)")
    deploy_mode: Literal["kserve", "deployment"] = Field(
        "kserve", description="how it is served: 'kserve' (InferenceService) or 'deployment' (a plain Deployment)")

    @field_validator(*dict.fromkeys(c.param for c in REFRESH_COVERAGE))
    @classmethod
    def _valid_for_its_config_key(cls, value: Any, info) -> Any:
        # Checked here, not only once merged into the run's config, so that the error names the parameter.
        (c,) = [c for c in REFRESH_COVERAGE if c.param == info.field_name]
        try:
            _key_adapter(c.key).validate_python(c.to_config(value))
        except ValidationError as exc:
            raise PydanticCustomError("config_key", "{msg} (config key {key})",
                                      {"msg": exc.errors()[0]["msg"], "key": c.key}) from None
        return value


REFRESH_MODELS = (RefreshParams, RunPlacement)


class RefreshRun(StrictModel):
    """Everything the steps of one refresh run need (``<refresh>/run.json``)."""

    refresh_uri: str
    params: RefreshParams
    config: RunConfig
    window_note: str | None = None  # set when the trigger chose the window's start (refresh.since was empty)
    # set when a promotion on record replaced the scheduled serving_draft (params.serving_draft is then the promoted)
    serving_note: str | None = None


def resolve_refresh(params: RefreshParams, config_text: str, refresh_uri: str, *,
                    rollout_deadline_s: int | None = None) -> RefreshRun:
    """Merge the typed parameters into the config YAML and validate everything (the module docstring's rules).
    With a rollout, its settings must fit the rollout step's deadline: ``rollout_deadline_s``, else the one
    :data:`ROLLOUT_DEADLINE_ENV` holds (None and unset: not known here, not checked)."""
    cfg = config_with_params(params, config_text, REFRESH_OWNED, REFRESH_COVERAGE,
                             "the refresh pipeline sets itself")
    if params.rollout_routing != "none":
        cfg = cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={"routing": params.rollout_routing})})
        deadline = rollout_deadline_s if rollout_deadline_s is not None else _deadline_from_env()
        if deadline is not None:
            r = cfg.rollout
            check_rollout_deadline(r.window_s, r.ready_timeout_s, r.poll_s, deadline)
    return RefreshRun(refresh_uri=refresh_uri, params=params, config=cfg)


def _deadline_from_env() -> int | None:
    """The rollout step's deadline the compiled pipeline set in :data:`ROLLOUT_DEADLINE_ENV` (None: unset)."""
    text = os.environ.get(ROLLOUT_DEADLINE_ENV, "").strip()
    if not text:
        return None
    if not text.isdigit():
        raise ConfigError(f"{ROLLOUT_DEADLINE_ENV}={text[:40]!r} is not whole seconds (the rollout step's deadline, "
                          "set by the compiled refresh pipeline)")
    return int(text)


def refresh_parameters() -> list[str]:
    """The typed parameters the ``trigger`` component takes (and passes on to :func:`resolve_refresh`)."""
    return list(RefreshParams.model_fields)


def check_refresh_arguments(args: dict[str, Any], *, rollout_deadline_s: int | None = None) -> dict[str, Any]:
    """The arguments of a refresh submission, validated as its first step validates them (ConfigError names
    the parameter or config key); returned as the parameters' types. ``rollout_deadline_s``: the rollout step's
    deadline of the profile the pipeline is compiled for (None: not known here)."""
    known = parameter_types(REFRESH_MODELS)
    unknown = [k for k in args if k not in known]
    if unknown:
        raise ConfigError(f"'{unknown[0]}' is not a parameter of the refresh pipeline; the parameters are "
                          + ", ".join(known))
    params = _validated(RefreshParams, {k: v for k, v in args.items() if k in RefreshParams.model_fields})
    placement = _validated(RunPlacement, {k: v for k, v in args.items() if k in RunPlacement.model_fields})
    resolve_refresh(params, placement.config, "/refresh", rollout_deadline_s=rollout_deadline_s)
    return {k: getattr(params if k in RefreshParams.model_fields else placement, k) for k in args}
