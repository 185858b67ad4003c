"""``evaluate`` section of the run configuration (conventions of :mod:`peagle.config`).

Two modes, chosen by whether ``endpoint`` is set:

* **offline API** (default): vLLM runs here, in a child interpreter, on ``target.path`` — once
  without the draft (baseline throughput, greedy reference outputs) and once per K in
  ``num_speculative_tokens`` with the draft (``method: eagle3``, ``parallel_drafting: true``);
* **endpoint**: requests go to a served OpenAI-compatible vLLM (``vllm serve``, a KServe
  InferenceService); its Prometheus ``/metrics`` are read before and after each workload. K is
  whatever the server runs; the baseline comes from ``baseline_endpoint`` when given.
"""
from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from ..config import StrictModel, TargetSettings
from ..engine.settings import engine_section
from ..speed.settings import SpeedSettings
from .prompts import BUILTIN_CATEGORIES

# Each category is one batch; a larger KV cache on CPU (the baseline and every K in one child); a
# bounded wait for all engines together.
EvaluateEngineSettings = engine_section(
    "EvaluateEngineSettings", "The offline engines; max_model_len defaults to what the longest prompt plus "
    "max_tokens needs, at most the target's context length (config.json max_position_embeddings).",
    max_num_seqs=64, tensor_parallel_size=1, cpu_kv_cache_gib=4, timeout_s=7200.0)


class EvaluateSettings(StrictModel):
    """How a draft is evaluated against its target: prompts, K sweep, sampling, report and gate."""

    draft: str = Field("", description="P-EAGLE draft checkpoint directory (offline mode; also fingerprinted)")
    out: str = Field("", description="output directory for report.json and report.html (default: <work_dir>/evaluate)")

    # Workload
    prompt_sets: list[str] = Field(
        default_factory=lambda: list(BUILTIN_CATEGORIES),
        description="prompt sets: built-in categories (code math summarization qa translation writing), "
        "'mtbench', 'mtbench:<category>', 'sharegpt-heldout' (ShareGPT first turns no stage trains on) or "
        ".jsonl files; '<set>@N' keeps the first N prompts of each of its categories",
    )
    prompts_per_category: int | None = Field(None, ge=1, description="use only the first N prompts of each category")
    system_prompt: str | None = Field(None, description="system message prepended to every prompt")
    max_tokens: int = Field(256, ge=1, description="tokens generated per prompt")
    ignore_eos: bool = Field(False, description="keep generating past end-of-sequence (fixed-length outputs)")

    # Speculation and sampling
    num_speculative_tokens: list[int] | None = Field(
        None, description="offline mode: K values to sweep (one engine each); default 1..the draft's trained depths "
        "(an endpoint serves its own K)"
    )
    sweep_k: list[int] = Field(
        default_factory=list, description="offline mode: more K values measured besides num_speculative_tokens "
        "(one engine each, all prompts; a draft trained for K depths serves any k <= K), for the AL/speedup vs K "
        "plots; values above the draft's trained depths are left out")
    allow_untrained_depths: bool = Field(
        False, description="allow K above the draft's trained depths (vLLM 0.32 accepts any K for a P-EAGLE draft; "
        "the extra positions were never trained)"
    )
    headline_num_speculative_tokens: int | None = Field(
        None, ge=1, description="K of the summary and the gate; default the draft's trained depths if swept, else the largest K"
    )
    temperatures: list[float] = Field(
        default_factory=lambda: [0.0, 0.7],
        description="sampling temperatures to evaluate; 0 = greedy (also checks losslessness)",
    )
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="nucleus sampling for temperatures above 0")
    seed: int = Field(0, description="per-request sampling seed (reproducible sampled runs)")
    timing_repeats: int = Field(
        1, ge=1, description="offline mode: run each batch this many times and time the fastest (noisy machines)"
    )
    measure_baseline: bool = Field(
        True, description="also run the target without the draft: throughput speedup and greedy losslessness"
    )

    # Engine (offline mode)
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field("auto", description="dtype vLLM runs the target in")
    engine: EvaluateEngineSettings = Field(
        default_factory=EvaluateEngineSettings, description="offline mode: the vLLM engines "
        "(peagle.engine.settings); engine.timeout_s limits all of them together")

    # Speed per load (offline mode)
    speed: SpeedSettings = Field(default_factory=SpeedSettings, description="speed per load: the load ladder, "
                                 "the K values measured on it, the speculation schedule and the speed gate")

    # Endpoint mode
    endpoint: str = Field("", description="base URL of a served vLLM (OpenAI API + /metrics), e.g. a KServe URL")
    baseline_endpoint: str = Field("", description="base URL serving the target without a draft (speedup, losslessness)")
    endpoint_model: str = Field("", description="served model name (default: the first of /v1/models)")
    metrics_url: str = Field("", description="Prometheus metrics URL if not <endpoint>/metrics")
    endpoint_concurrency: int = Field(16, ge=1, description="concurrent requests per workload")
    endpoint_token_env: str = Field(
        "PEAGLE_ENDPOINT_TOKEN", description="environment variable with a bearer token for the endpoint (if set)"
    )
    endpoint_insecure: bool = Field(False, description="do not verify the endpoint's TLS certificate")
    request_timeout_s: float = Field(600.0, gt=0, description="limit per HTTP request")

    # Offline agreement on held-out hidden states
    hidden_states: str = Field("", description="extraction output directory of held-out samples (offline metrics)")
    offline_max_samples: int | None = Field(256, ge=1, description="samples read for the offline metrics")
    offline_device: str = Field("cpu", description="torch device of the offline draft forward")

    # Gate
    min_acceptance_length: float | None = Field(
        None, ge=1.0, description="fail (exit 1) if the headline acceptance length is below this"
    )
    dead_draft_acceptance_length: float | None = Field(
        1.02, ge=1.0, description="fail whatever else passes if the headline acceptance length is at most this "
        "(a draft that almost never proposes an accepted token only costs time); null: no such floor")
    require_lossless: bool = Field(False, description="fail (exit 1) if greedy outputs differ with the draft "
                                   "(judged on the float32 check when it ran: bf16 differences can be numeric noise)")

    # Trust (offline mode): where greedy identity is decidable, and what the target itself does
    lossless_check: Literal["none", "float32"] = Field(
        "none", description="float32: also run the target alone and with the draft (largest K) in float32 on a few "
        "prompts; their greedy outputs must be identical (bf16 outputs may differ by numeric noise alone)")
    lossless_check_prompts: int = Field(8, ge=1, description="prompts of the float32 check (the first of each "
                                        "category in turn)")
    lossless_check_max_tokens: int = Field(32, ge=1, description="tokens per prompt in the float32 check")
    self_consistency: bool = Field(
        True, description="rerun the target's greedy prompts as one batch in another order: how often the target "
        "alone reproduces its own outputs (the noise floor for 'greedy outputs identical')")

    @field_validator("num_speculative_tokens")
    @classmethod
    def _positive_ks(cls, v: list[int] | None) -> list[int] | None:
        if v is not None:
            if not v or any(k < 1 for k in v):
                raise ValueError(f"K values must be >= 1, got {v}")
            v = sorted(set(v))
        return v

    @field_validator("sweep_k")
    @classmethod
    def _sweep_ks(cls, v: list[int]) -> list[int]:
        if any(k < 1 for k in v):
            raise ValueError(f"sweep_k values must be >= 1, got {v}")
        return sorted(set(v))

    @field_validator("temperatures")
    @classmethod
    def _temperatures(cls, v: list[float]) -> list[float]:
        if not v or any(t < 0 for t in v):
            raise ValueError(f"temperatures must be a non-empty list of values >= 0, got {v}")
        return list(dict.fromkeys(v))

    @model_validator(mode="after")
    def _endpoint_or_draft(self) -> "EvaluateSettings":
        if self.baseline_endpoint and not self.endpoint:
            raise ValueError("baseline_endpoint needs endpoint")
        return self


class EvaluateRunConfig(StrictModel):
    """What ``python -m peagle.evaluate`` reads: the target, the evaluate section and a work dir."""

    target: TargetSettings = Field(default_factory=TargetSettings)
    evaluate: EvaluateSettings = Field(default_factory=EvaluateSettings)
    work_dir: str = Field("runs/local", description="where local outputs go")
