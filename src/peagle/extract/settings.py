"""``extract`` section of the run configuration, and the layer ids it resolves to.

Conventions as in :mod:`peagle.config`: every field has a description (it becomes a CLI flag's
help), unknown keys are errors.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import Field, field_validator, model_validator

from ..config import StrictModel
from ..engine.settings import engine_section
from ..model.target import check_aux_layer_ids, default_aux_layer_ids

NUM_AUX_LAYERS = 3

# Extraction generates one token per request: eager (CUDA graphs would only cost start-up), every
# sample computed in full (prefix caching would reuse another batch's hidden states), and the batch
# and memory share the backend has always used.
ExtractEngineSettings = engine_section(
    "ExtractEngineSettings", "The vllm backend's engine; max_model_len defaults to the longest pending sample + 1.",
    max_num_seqs=8, enforce_eager=True, enable_prefix_caching=False, gpu_memory_utilization=0.9,
    tensor_parallel_size=1)


class ExtractSettings(StrictModel):
    """How target hidden states are captured for draft training (``peagle extract``)."""

    backend: Literal["vllm", "hf"] = Field(
        "vllm",
        description="'vllm': vLLM's extract_hidden_states method (production); "
        "'hf': transformers forward passes with identical semantics (reference, small runs)",
    )
    aux_layer_ids: list[int] | None = Field(
        None,
        description="target layers whose input residual stream feeds the draft (exactly 3, ascending, "
        "< num_hidden_layers); default [2, n//2, n-3]. The last layer's pre-norm output is always added",
    )
    samples_per_shard: int = Field(64, ge=1, description="samples per safetensors shard")
    sets_per_worker: int = Field(
        1, ge=1, description="shard sets each extraction worker writes, one after the other, publishing each "
        "as soon as it is done: more sets let a streaming trainer (train.data_mode=streaming) start earlier "
        "and hold a smaller window")
    max_sets_ahead: int | None = Field(
        None, ge=1, description="back-pressure for streaming runs that delete consumed sets "
        "(train.stream.delete_consumed): shard set s >= N waits until the trainer has consumed set s - N (N raised "
        "to what its plan needs, which it announces). Bounds the hidden states in the bucket to about N sets. "
        "Needs train.data_mode=streaming with train.stream.delete_consumed and a trainer running beside the "
        "workers (peagle run trains after extraction: refused there). Default: no waiting")
    max_sets_ahead_timeout_s: float = Field(
        86400.0, gt=0, description="extract.max_sets_ahead: fail when a shard set has waited this long for the "
        "trainer to announce itself or to consume the set it waits for (a trainer that died or never started)")
    storage_dtype: Literal["bfloat16", "fp8"] = Field(
        "bfloat16",
        description="dtype of stored hidden states; 'fp8' = float8_e4m3fn with a float32 scale per token "
        "and layer (about half the bytes)",
    )
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        "auto", description="dtype the target runs in; 'auto' = the dtype in the target's config.json"
    )
    batch_size: int = Field(
        8, ge=1, description="hf backend: samples per forward pass (the vllm backend's concurrent requests are "
        "extract.engine.max_num_seqs)")
    hf_device: str = Field("auto", description="hf backend device: 'auto' (cuda when available), 'cpu', 'cuda:0'")
    scratch_dir: str | None = Field(
        None, description="vllm: where per-request hidden-state files land before sharding; default: system temp"
    )
    seed: int = Field(0, description="engine seed (extraction is deterministic; only sampling of the 1 token uses it)")
    engine: ExtractEngineSettings = Field(
        default_factory=ExtractEngineSettings, description="the vllm backend's engine (peagle.engine.settings)")

    @field_validator("aux_layer_ids")
    @classmethod
    def _three_aux_layers(cls, v: list[int] | None) -> list[int] | None:
        if v is not None:
            if len(v) != NUM_AUX_LAYERS:
                raise ValueError(f"exactly {NUM_AUX_LAYERS} aux layer ids are required, got {len(v)}: {v}")
            if any(i < 0 for i in v) or sorted(set(v)) != list(v):
                raise ValueError(f"aux layer ids must be distinct, non-negative and ascending, got {v}")
        return v

    @model_validator(mode="after")
    def _engine_in_its_own_process(self) -> "ExtractSettings":
        if self.engine.in_process:  # docs/acceptance.md, section 1
            raise ValueError("extract.engine.in_process: an in-process extraction engine deadlocks on the KV "
                             "connector's per-request file lock (its writer thread holds it through the engine "
                             "step); leave it false")
        return self


@dataclass(frozen=True)
class LayerIds:
    """What one extraction captures.

    ``aux`` id k is the residual stream *entering* decoder layer k (transformers'
    ``output_hidden_states[k]``, vLLM's aux-hidden-state id k). ``last`` = num_hidden_layers is the
    last decoder layer's output *before* the final norm (not transformers' ``hidden_states[n]``,
    which is after it). ``all`` is the list handed to vLLM, in storage order.
    """

    aux: tuple[int, int, int]
    last: int

    @property
    def all(self) -> list[int]:
        return [*self.aux, self.last]


def resolve_layer_ids(aux_layer_ids: list[int] | None, num_hidden_layers: int) -> LayerIds:
    """Aux ids (given or the default [2, n//2, n-3]) checked against the target, plus the last layer n."""
    aux = list(aux_layer_ids) if aux_layer_ids is not None else default_aux_layer_ids(num_hidden_layers)
    check_aux_layer_ids(aux, num_hidden_layers)
    if len(aux) != NUM_AUX_LAYERS or sorted(set(aux)) != aux:
        raise ValueError(f"aux layer ids must be {NUM_AUX_LAYERS} distinct ascending ids, got {aux}")
    return LayerIds(aux=(aux[0], aux[1], aux[2]), last=int(num_hidden_layers))
