"""``gate`` section of the run configuration: when a candidate draft counts (see :mod:`peagle.config` for the
conventions)."""
from __future__ import annotations

from pydantic import Field

from ..config import StrictModel


class GateSettings(StrictModel):
    """When a candidate draft counts: paired comparison with the serving draft on the same prompts."""

    margin: float = Field(0.02, ge=0.0, le=10.0,
                          description="least acceptance-length gain on the held-out traffic (interval low must be > 0)")
    tolerance: float = Field(0.05, ge=0.0, le=10.0,
                             description="largest acceptance-length loss allowed on the general held-out set")
    general: str = Field("sharegpt-heldout@32", description="general held-out prompt set (see peagle.evaluate.prompts)")
    neighbour: str = Field("auto", description="prompts of the traffic's domain from another source, measured "
                           "besides the traffic and general sets (peagle.gate.neighbour): a prompt set name "
                           "(peagle.evaluate.prompts; several joined with '+'), 'auto' (the project's and "
                           "MT-Bench's slice for the traffic's detected domain: code, math; none for other "
                           "traffic) or '' (none)")
    neighbour_tolerance: float = Field(0.02, ge=0.0, le=10.0, description="largest acceptance-length loss allowed "
                                       "on the neighbouring set (the traffic's domain: a refresh must carry its gain "
                                       "there, so no more than the least gain gate.margin asks on the traffic)")
    min_traffic_prompts: int = Field(16, ge=1, description="fewer held-out traffic prompts than this: rejected")
    max_traffic_prompts: int | None = Field(64, ge=1, description="newest held-out traffic prompts evaluated at most")
    max_tokens: int = Field(96, ge=1, le=8192, description="tokens generated per prompt")
    num_speculative_tokens: int | None = Field(None, ge=1, description="K served (default: the drafts' trained depths)")
    level: float = Field(0.95, gt=0.5, lt=1.0, description="confidence level of the bootstrap intervals")
    resamples: int = Field(1000, ge=100, le=100_000, description="bootstrap resamples")
    lossless_prompts: int = Field(4, ge=0, description="prompts of the float32 losslessness check (0: skip -> rejected)")
    lossless_max_tokens: int = Field(32, ge=1, le=8192, description="tokens per prompt in the float32 check")
    seed: int = Field(0, description="seed of the bootstrap")
    speed_concurrency: int | None = Field(
        8, ge=1, description="the deployed load: requests kept in flight while the candidate's speed is measured "
        "against the serving draft and the target alone (one engine each, same K, the traffic prompts); null: "
        "speed not checked")
    speed_requests_per_load: int = Field(3, ge=1, description="requests sent at that load: this many times it")
    speed_rounds: int = Field(2, ge=1, description="times the three engines run that load, in alternating order "
                              "(serving, candidate, target alone; then backward): a slow spell on the machine falls "
                              "on all three")
    speed_max_tokens: int | None = Field(None, ge=1, le=8192, description="tokens per request of the speed "
                                         "measurement (default: gate.max_tokens)")
    speed_tolerance: float = Field(0.03, ge=0.0, lt=1.0, description="the candidate may be at most this much slower "
                                   "than the serving draft, and than the target alone, at that load (tokens/s)")
