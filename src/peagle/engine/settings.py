"""``engine`` sub-section of regenerate, extract and evaluate: how their offline vLLM engine is built.

One set of keys with one meaning each (``extract.engine.max_num_seqs`` and
``evaluate.engine.max_num_seqs`` are the same lever); :func:`peagle.engine.llm.engine_kwargs` turns
them into ``vllm.LLM`` arguments. None means "vLLM's own default" (the argument is not passed),
except ``enforce_eager``, where None means eager on CPU and compiled on GPU.

A stage whose engine differs on purpose gets its own defaults with :func:`engine_section` (a
subclass, so a user who sets one engine key of that stage keeps the stage's defaults for the rest).
"""
from __future__ import annotations

import copy
from typing import Any

from pydantic import Field, create_model

from ..config import StrictModel


class EngineSettings(StrictModel):
    """The offline vLLM engine of a stage (CPU or GPU)."""

    max_model_len: int | None = Field(
        None, ge=16, description="context length; default: the stage's (extract: longest sample + 1, evaluate: what "
        "the prompts need, regenerate: the model's)")
    max_num_seqs: int | None = Field(None, ge=1, description="concurrent sequences; default: vLLM's")
    max_num_batched_tokens: int | None = Field(None, ge=1, description="tokens per engine step; default: vLLM's")
    enable_chunked_prefill: bool | None = Field(
        None, description="split long prefills across engine steps; default: vLLM's")
    enable_prefix_caching: bool | None = Field(
        None, description="reuse the KV cache of shared prompt prefixes; default: vLLM's")
    enforce_eager: bool | None = Field(
        None, description="no CUDA graphs / compilation; default: eager on CPU, compiled on GPU")
    gpu_memory_utilization: float | None = Field(
        None, gt=0.0, le=1.0, description="on GPU: share of GPU memory for weights + KV cache; default: vLLM's")
    tensor_parallel_size: int | None = Field(None, ge=1, description="tensor parallelism; default: vLLM's (1)")
    cpu_kv_cache_gib: int = Field(
        1, ge=1, description="on CPU: KV-cache size in GiB (VLLM_CPU_KVCACHE_SPACE; one set in the environment wins)")
    cpu_threads: int | None = Field(
        None, ge=1, description="on CPU: OpenMP threads of the model, unbound (default: vLLM's, which leaves cores "
        "to its scheduler)")
    in_process: bool = Field(
        False, description="run vLLM's engine core inside the stage's child interpreter (starts in seconds; one "
        "process less competing for cores)")
    timeout_s: float | None = Field(
        None, gt=0, description="kill the engine's child interpreter (and its workers) after this many seconds "
        "(evaluate: all its engines together); default: no limit")


def engine_section(name: str, doc: str, **defaults: Any) -> type[EngineSettings]:
    """An :class:`EngineSettings` subclass named ``name`` whose fields default to ``defaults`` (their help
    says so)."""
    fields: dict[str, Any] = {}
    for key, value in defaults.items():
        info = copy.copy(EngineSettings.model_fields[key])
        info.default = value
        info.description = f"{info.description} (this stage: {value})"
        fields[key] = (info.annotation, info)
    return create_model(name, __base__=EngineSettings, __doc__=doc, __module__=__name__, **fields)
