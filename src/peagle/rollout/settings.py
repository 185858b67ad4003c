"""Settings of the rollout and of the refresh trigger: the ``rollout`` and ``trigger`` run-config sections.

This module imports only pydantic, :mod:`peagle.config` and the decision record's routings
(``peagle.run_config`` assembles it).
"""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from ..config import MAX_DURATION_S, StrictModel
from ..records.decision import ROUTINGS


class RegistrySettings(StrictModel):
    """Where promoted drafts are registered: the OpenShift AI (Kubeflow) Model Registry REST API."""

    url: str = Field("", description="Model Registry REST endpoint, e.g. https://<registry>-rest.<apps domain> "
                     "(\"\": no registry; promotions are still recorded in the loop history)")
    model_name: str = Field("", description="registered model the promoted drafts are versions of "
                            "(\"\": peagle-draft-<first 12 digits of the target fingerprint>)")
    token_env: str = Field("PEAGLE_REGISTRY_TOKEN",
                           description="environment variable holding the bearer token (never stored in the config); "
                           "unset: the pod's ServiceAccount token")
    timeout_s: float = Field(30.0, gt=0, le=600, description="limit of each request to the registry")
    verify_tls: bool = Field(True, description="verify the registry's TLS certificate")


class RolloutSettings(StrictModel):
    """Rolling a gated candidate out beside the serving draft, deciding on live acceptance."""

    routing: Literal[ROUTINGS] = Field(
        "route", description="how traffic is split: an OpenShift Route's weighted alternateBackends (the default: "
        "the split that works on OpenShift AI), a Gateway API HTTPRoute's weighted backendRefs, or KServe's "
        "canary (RawDeployment/Standard spec.canary, KServe >= 0.20; it splits requests only through KServe's "
        "Gateway API ingress). docs/traffic.md, Routing options, says what each needs")
    canary_percent: int = Field(10, ge=1, le=99, description="share of traffic sent to the candidate (percent)")
    min_requests: int = Field(200, ge=1, description="live requests each version must have answered before deciding "
                              "(the interval of the AL difference narrows as 1/sqrt(n): +-0.04 measured at 64 per version on "
                              "HumanEval, about +-0.025 at 200)")
    window_s: float = Field(3600.0, gt=0, le=MAX_DURATION_S,
                            description="longest canary window: without enough requests by then, roll back")
    poll_s: float = Field(30.0, gt=0, le=3600, description="how often the live records are read while waiting")
    margin: float = Field(0.0, ge=-10.0, le=10.0,
                          description="promote only if live AL(candidate) - AL(stable) is at least this")
    tolerance: float = Field(0.05, ge=0.0, le=10.0,
                             description="... and the low end of its interval is at least -tolerance")
    speed_tolerance: float = Field(
        0.03, ge=0.0, le=10.0, description="roll back a candidate whose time per output token is above the stable "
        "draft's by more than this share (its interval above parity), whatever its acceptance")
    level: float = Field(0.95, gt=0.5, lt=1.0, description="confidence level of the live intervals")
    resamples: int = Field(1000, ge=100, le=100_000, description="bootstrap resamples")
    seed: int = Field(0, description="seed of the bootstrap")
    ready_timeout_s: float = Field(1800.0, gt=0, le=MAX_DURATION_S,
                                   description="wait this long for a canary or a promoted stable to serve")
    in_place: bool = Field(True, description="promote by swapping the draft inside the stable's running pods, one at a "
                       "time, where the stable serves the swap endpoint (chart swap.enabled): no restart; a pod that "
                       "refuses falls back to the restart. false: always restart the stable (peagle rollout local: --swap)")
    swap_token_env: str = Field("PEAGLE_SWAP_TOKEN", min_length=1,
                                description="environment variable holding the swap endpoint's bearer token (the "
                                "Secret of the chart's swap.tokenSecret; never stored in the config)")
    swap_timeout_s: float = Field(600.0, gt=0, le=MAX_DURATION_S, description="limit of one pod's swap")
    history: str = Field("", description="loop history root (refreshes, decisions, promotions): a local directory "
                         "or s3:// URI (\"\": <refresh.traffic>/_loop)")
    registry: RegistrySettings = Field(default_factory=RegistrySettings)


class TriggerSettings(StrictModel):
    """When a scheduled refresh goes on (its first step decides; otherwise the run ends green, 'not needed')."""

    min_new_records: int = Field(500, ge=1, description="go on when this many usable records arrived since the "
                                 "last refresh's window ended")
    acceptance_drop: float = Field(0.1, gt=0.0, le=10.0,
                                   description="... or when live AL of the serving draft on recent traffic fell by "
                                   "this much below what was measured when it was promoted")
    recent_records: int = Field(200, ge=1, description="newest records of the serving draft that make 'recent'")
    min_recent_records: int = Field(32, ge=1, description="fewer recent records than this: no acceptance verdict")
    force: bool = Field(False, description="always go on (a manual run)")
