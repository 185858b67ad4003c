"""Settings of the traffic loop: capture (serving side) and refresh (a run configuration section).

``CaptureSettings`` is read by the ASGI middleware inside vLLM's API server, which gets no arguments
from vLLM: every field travels as one environment variable ``PEAGLE_CAPTURE_<FIELD>`` (lists and
booleans as JSON). ``peagle serve`` and the Helm chart set exactly these variables, so the three cannot
drift. ``RefreshSettings`` is the ``refresh`` section of the one run configuration
(:mod:`peagle.run_config`; it stays below the refresh, which the trainer's entry point would otherwise reach
through the assembly: docs/structure.md). This module imports only pydantic,
:mod:`peagle.config` and :mod:`peagle.traffic.redact` (the middleware imports it inside the server).
"""
from __future__ import annotations

import json
from typing import Any, Literal, Mapping

from pydantic import Field, ValidationError, field_validator

from ..config import ConfigError, StrictModel

ENV_PREFIX = "PEAGLE_CAPTURE_"


class CaptureSettings(StrictModel):
    """Opt-in capture of served requests into an append-only, time-partitioned traffic log."""

    enabled: bool = Field(False, description="capture served requests (off unless turned on)")
    uri: str = Field("", description="traffic log root: a local directory or s3:// URI")
    sample_rate: float = Field(1.0, ge=0.0, le=1.0, description="fraction of requests captured")
    flush_interval_s: float = Field(10.0, gt=0.0, le=3600.0,
                                    description="publish a batch at least this often while records wait")
    batch_records: int = Field(256, ge=1, le=100_000, description="publish a batch once this many records wait")
    queue_records: int = Field(4096, ge=1, le=1_000_000,
                               description="records held in memory at most; beyond, records are dropped and counted")
    max_record_bytes: int = Field(1 << 20, ge=1024, le=64 << 20,
                                  description="a request or response larger than this is not captured (counted)")
    retention_days: int = Field(30, ge=0, le=3660,
                                description="delete batches older than this many days (0: keep everything)")
    redact: list[str] = Field(["default"], description="redaction patterns applied before anything is written: "
                              "'default' (the documented set), a pattern name, or 're:<regex>'; [] redacts nothing")
    target_dir: str = Field("", description="served target directory (its fingerprint is recorded)")
    draft_dir: str = Field("", description="served draft directory (its fingerprint is recorded)")
    target_fingerprint: str = Field("", description="recorded target fingerprint (default: computed from target_dir)")
    draft_fingerprint: str = Field("", description="recorded draft fingerprint (default: computed from draft_dir)")

    @field_validator("redact")
    @classmethod
    def _patterns_compile(cls, names: list[str]) -> list[str]:
        # compiled here, where the settings are built (peagle serve's flags, the chart's variables), so a
        # bad pattern stops the command at once, not inside the server after minutes of model loading
        from .redact import Redactor

        try:
            Redactor.from_settings(names)
        except ConfigError as e:
            raise ValueError(str(e)) from None
        return names

    def to_env(self) -> dict[str, str]:
        """One ``PEAGLE_CAPTURE_<FIELD>`` variable per field (lists and booleans as JSON)."""
        env = {}
        for name, value in self.model_dump().items():
            env[ENV_PREFIX + name.upper()] = value if isinstance(value, str) else json.dumps(value)
        return env

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> "CaptureSettings":
        """Settings from ``PEAGLE_CAPTURE_*`` variables; an unknown or bad variable is a ConfigError naming it."""
        values: dict[str, Any] = {}
        for key, raw in env.items():
            if not key.startswith(ENV_PREFIX):
                continue
            name = key[len(ENV_PREFIX):].lower()
            if name not in cls.model_fields:
                raise ConfigError(f"{key}: not a capture setting (known: "
                                  f"{', '.join(ENV_PREFIX + f.upper() for f in cls.model_fields)})")
            if cls.model_fields[name].annotation is str:
                values[name] = raw
            else:
                try:
                    values[name] = json.loads(raw)
                except ValueError:
                    raise ConfigError(f"{key}: not JSON ({raw[:80]!r})") from None
        try:
            return cls(**values)
        except ValidationError as exc:
            err = exc.errors()[0]
            field = ENV_PREFIX + str(err["loc"][0]).upper() if err.get("loc") else ENV_PREFIX
            raise ConfigError(f"{field}: {err['msg']}") from None


class RefreshSettings(StrictModel):
    """Turning a window of captured traffic into a candidate draft (``peagle refresh``)."""

    traffic: str = Field("", description="traffic log root written by the capture (local directory or s3:// URI)")
    since: str = Field("", description="window start, ISO 8601 UTC (inclusive; empty: the oldest record)")
    until: str = Field("", description="window end, ISO 8601 UTC (exclusive; empty: now, the time of the selection; "
                       "records dated later are counted as future and left out)")
    heldout_fraction: float = Field(0.25, gt=0.0, lt=1.0,
                                    description="newest fraction of the window's distinct prompts kept for the gate, "
                                    "never trained on")
    min_heldout: int = Field(16, ge=1, description="held-out slice has at least this many distinct prompts")
    max_records: int | None = Field(None, ge=1, description="newest records of the window used at most")
    dedupe: bool = Field(True, description="drop records whose conversation and response repeat an earlier one")
    max_per_template: int | None = Field(
        None, ge=1, description="training records kept at most per prompt template (the first line of the "
        "user's last message, digits masked: one client's instruction wrapped around many inputs), the newest; "
        "null: no cap. Held-out records are not capped")
    replay_fraction: float = Field(0.25, ge=0.0, lt=1.0,
                                   description="fraction of the training rows drawn from the serving draft's own "
                                   "training data (guards against forgetting)")
    base_data: str = Field("", description="prepared data the serving draft was trained on (replay source)")
    epochs: int = Field(
        2, ge=1, le=100, description="passes of the refresh's training over the window's rows (it sets train.epochs "
        "for the refresh: the run's train.epochs is its main training's); with refresh.anchor_weight and the "
        "lower, re-warmed learning rate, two passes learn the window without losing next door or on general "
        "chat (docs/traffic.md, What each lever buys)")
    lr_scale: float = Field(
        0.3, gt=0.0, le=10.0, description="the refresh's learning rate as a multiple of the run's train.lr (the "
        "serving draft's own, which a warm start would otherwise take at once); 1: the run's")
    warmup_steps: int | None = Field(
        25, ge=0, description="the refresh's learning-rate warmup in steps (it sets train.warmup_steps for the "
        "refresh: the warm-started weights are re-warmed); null: the run's train.warmup_steps")
    anchor_weight: float = Field(
        1.0, ge=0.0, le=100.0, description="the refresh's KL term to the serving draft's own predictions (it sets "
        "train.anchor_weight for the refresh's training): keeps the candidate near the serving draft where the "
        "window says little, so a gain on the window does not cost the neighbouring traffic; 0: none")
    rejected_weight: float = Field(
        0.0, ge=0.0, le=100.0, description="extra weight on the positions the serving draft gets wrong (it sets "
        "train.rejected_weight for the refresh's training); 0: none")
    sampled_responses: Literal["keep", "drop", "regenerate"] = Field(
        "keep", description="responses sampled at temperature > 0: train on them, drop them, or let the target "
        "regenerate them greedily")
    vocab: Literal["keep", "rederive"] = Field(
        "keep", description="draft vocabulary of the candidate: the serving draft's, or re-derived from the new rows")
    seed: int = Field(0, description="seed of the replay draw")
