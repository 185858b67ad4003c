"""DraftSpec: the fully resolved description of one P-EAGLE draft.

It is what the model is built from and what the checkpoint adapter writes to ``config.json``:
user settings (:class:`peagle.config.DraftSettings`) resolved against a concrete target config.
``layer_config`` is the Hugging Face config dict of the draft decoder (``transformer_layer_config``
in the speculators format) — vLLM builds the draft's config from exactly this dict.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

SUPPORTED_DRAFT_ARCHS = ("llama", "qwen3")


class DraftSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    arch: Literal["llama", "qwen3"]
    layer_config: dict[str, Any]
    draft_vocab_size: int = Field(ge=1)
    mask_token_id: int = Field(ge=0)
    aux_layer_ids: list[int]
    norm_before_residual: bool
    norm_before_fc: bool = False
    num_depths: int = Field(ge=1)
    verifier_name_or_path: str
    verifier_architectures: list[str]

    @model_validator(mode="after")
    def _consistent(self) -> "DraftSpec":
        lc = self.layer_config
        for key in ("hidden_size", "vocab_size", "num_attention_heads", "num_key_value_heads",
                    "intermediate_size", "num_hidden_layers", "rms_norm_eps"):
            if key not in lc:
                raise ValueError(f"transformer_layer_config.{key} is missing")
        if lc.get("model_type") != self.arch:
            raise ValueError(
                f"transformer_layer_config.model_type is {lc.get('model_type')!r} but arch is {self.arch!r}"
            )
        if self.draft_vocab_size > lc["vocab_size"]:
            raise ValueError(
                f"draft_vocab_size {self.draft_vocab_size} exceeds the target vocabulary {lc['vocab_size']}"
            )
        if self.mask_token_id >= lc["vocab_size"]:
            raise ValueError(f"mask_token_id {self.mask_token_id} is outside the vocabulary (size {lc['vocab_size']})")
        if len(self.aux_layer_ids) != 3:
            raise ValueError(f"eagle_aux_hidden_state_layer_ids must hold 3 ids, got {self.aux_layer_ids}")
        rope = lc.get("rope_parameters") or lc.get("rope_scaling") or {}
        if isinstance(rope, dict) and "mrope_section" in rope:
            raise ValueError("transformer_layer_config carries M-RoPE (mrope_section); vLLM's P-EAGLE path rejects it")
        return self

    # Convenience views -----------------------------------------------------------------------
    @property
    def hidden_size(self) -> int:
        return int(self.layer_config["hidden_size"])

    @property
    def vocab_size(self) -> int:
        return int(self.layer_config["vocab_size"])

    @property
    def num_layers(self) -> int:
        return int(self.layer_config["num_hidden_layers"])

    @property
    def num_aux(self) -> int:
        return len(self.aux_layer_ids)

    @property
    def layer_types(self) -> list[str]:
        return list(self.layer_config.get("layer_types") or ["full_attention"] * self.num_layers)

    @property
    def sliding_window(self) -> int | None:
        return self.layer_config.get("sliding_window")

    def hf_layer_config(self):
        """The draft decoder's config as a transformers config object."""
        from transformers import LlamaConfig, Qwen3Config

        cls = Qwen3Config if self.arch == "qwen3" else LlamaConfig
        d = {k: v for k, v in self.layer_config.items() if k not in ("model_type", "transformers_version")}
        return cls(**d)


def target_sliding_window(target_config) -> int | None:
    """The target's sliding window, if the target really uses one (Qwen configs carry a window but
    switch it off with ``use_sliding_window: false``; others list ``sliding_attention`` layers)."""
    window = getattr(target_config, "sliding_window", None)
    if not window:
        return None
    if hasattr(target_config, "use_sliding_window"):
        return int(window) if target_config.use_sliding_window else None
    layer_types = getattr(target_config, "layer_types", None)
    if layer_types:
        return int(window) if "sliding_attention" in layer_types else None
    return int(window)


def build_layer_config(
    target_config, arch: str, num_layers: int, sliding_window: int | None, full_attention_layers: list[int]
) -> dict[str, Any]:
    """Draft decoder config derived from the target's config (dims, norms, RoPE copied).

    ``sliding_window=None`` inherits the target's window when the target uses one.
    """
    from transformers import LlamaConfig, Qwen3Config

    tc = target_config
    if sliding_window is None:
        sliding_window = target_sliding_window(tc)
    head_dim = getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads
    if sliding_window is None:
        layer_types = ["full_attention"] * num_layers
    else:
        bad = [i for i in full_attention_layers if not 0 <= i < num_layers]
        if bad:
            raise ValueError(f"draft.full_attention_layers {bad} out of range for {num_layers} layers")
        layer_types = [
            "full_attention" if i in full_attention_layers else "sliding_attention" for i in range(num_layers)
        ]
    rope = getattr(tc, "rope_parameters", None)
    kwargs: dict[str, Any] = dict(
        vocab_size=tc.vocab_size,
        hidden_size=tc.hidden_size,
        intermediate_size=tc.intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=tc.num_attention_heads,
        num_key_value_heads=getattr(tc, "num_key_value_heads", None) or tc.num_attention_heads,
        head_dim=head_dim,
        hidden_act="silu",
        max_position_embeddings=tc.max_position_embeddings,
        initializer_range=getattr(tc, "initializer_range", 0.02),
        rms_norm_eps=getattr(tc, "rms_norm_eps", 1e-6),
        tie_word_embeddings=False,
        attention_bias=False,
        layer_types=layer_types,
        sliding_window=sliding_window,
    )
    if rope:
        kwargs["rope_parameters"] = {k: v for k, v in dict(rope).items() if k != "partial_rotary_factor"}
    if arch == "qwen3":
        kwargs["use_sliding_window"] = sliding_window is not None
        cfg = Qwen3Config(**kwargs)
    else:
        kwargs["mlp_bias"] = False
        cfg = LlamaConfig(**kwargs)
    d = cfg.to_dict()
    # Drop HF bookkeeping that means nothing for a draft decoder.
    for k in ("id2label", "label2id", "architectures", "_name_or_path", "problem_type", "output_hidden_states",
              "return_dict", "chunk_size_feed_forward", "is_encoder_decoder", "output_attentions"):
        d.pop(k, None)
    return d
