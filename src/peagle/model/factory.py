"""Build a draft for a target: resolve settings into a DraftSpec and initialise weights from the target."""
from __future__ import annotations

import logging
from collections.abc import Mapping

import torch

from ..config import DraftSettings
from .draft import PEagleDraftModel
from .spec import DraftSpec, build_layer_config
from .target import (
    TargetError,
    TargetInfo,
    check_aux_layer_ids,
    default_aux_layer_ids,
    inspect_target,
    read_target_tensors,
    resolve_mask_token_id,
    target_embedding_and_head,
)
from .vocab import build_vocab_maps

log = logging.getLogger(__name__)


def load_tokenizer(info: TargetInfo, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(info.path), trust_remote_code=trust_remote_code)


def resolve_spec(info: TargetInfo, settings: DraftSettings, tokenizer=None) -> DraftSpec:
    aux = settings.aux_layer_ids or default_aux_layer_ids(info.num_layers)
    check_aux_layer_ids(aux, info.num_layers)
    mask = settings.mask_token_id
    if mask is None:
        mask = resolve_mask_token_id(tokenizer if tokenizer is not None else load_tokenizer(info), info.vocab_size)
    if mask >= info.vocab_size:
        raise TargetError(f"mask token id {mask} is outside the target vocabulary (size {info.vocab_size})")
    vd = settings.draft_vocab_size or info.vocab_size
    if vd > info.vocab_size:
        raise TargetError(f"draft_vocab_size {vd} exceeds the target vocabulary {info.vocab_size}")
    layer_config = build_layer_config(
        info.config, settings.arch, settings.num_layers, settings.sliding_window, settings.full_attention_layers
    )
    return DraftSpec(
        arch=settings.arch,
        layer_config=layer_config,
        draft_vocab_size=vd,
        mask_token_id=mask,
        aux_layer_ids=aux,
        norm_before_residual=settings.norm_before_residual,
        norm_before_fc=settings.norm_before_fc,
        num_depths=settings.num_depths,
        verifier_name_or_path=str(info.path),
        verifier_architectures=info.architectures,
    )


def check_draft_matches_target(spec: DraftSpec, info: TargetInfo, where: str = "draft") -> None:
    """Fail fast when a draft cannot pair with a target."""
    if spec.hidden_size != info.hidden_size:
        raise TargetError(
            f"{where}: hidden size {spec.hidden_size} does not match the target's {info.hidden_size} ({info.path})"
        )
    if spec.vocab_size != info.vocab_size:
        raise TargetError(
            f"{where}: vocabulary size {spec.vocab_size} does not match the target's {info.vocab_size} ({info.path})"
        )
    check_aux_layer_ids(spec.aux_layer_ids, info.num_layers)


def init_draft(
    target_dir: str,
    settings: DraftSettings,
    token_counts: Mapping[int, int] | None = None,
    trust_remote_code: bool = False,
) -> PEagleDraftModel:
    """An initialised (untrained) draft: random layers, target embedding, pruned target lm_head."""
    info = inspect_target(target_dir, trust_remote_code)
    spec = resolve_spec(info, settings)
    if token_counts is None and spec.draft_vocab_size < spec.vocab_size:
        log.warning("no token frequencies given: the draft vocabulary is ids 0..%d", spec.draft_vocab_size - 1)
    embed, head, _ = target_embedding_and_head(info)
    d2t, t2d = build_vocab_maps(token_counts, spec.vocab_size, spec.draft_vocab_size)
    model = PEagleDraftModel(spec)
    model.reset_parameters(settings.init_seed)
    if settings.init_from_target_layer:
        copied = init_layers_from_target_top(model, info)
        log.info("draft layers initialised from target layer %d: %d tensors", info.num_layers - 1, copied)
    with torch.no_grad():
        model.embed_tokens.weight.copy_(embed.float())
        model.lm_head.weight.copy_(head.float()[t2d])
        model.d2t.copy_(d2t)
        model.t2d.copy_(t2d)
    return model


def init_layers_from_target_top(model: PEagleDraftModel, info: TargetInfo) -> int:
    """Copy the target's top decoder layer into every draft layer where the shapes allow; returns
    the number of tensors copied (fails when none fits: the flag would silently do nothing).

    Layer 0 reads ``[norm(embeds); norm(features)]`` (2H): its q/k/v get the target's weights on
    the feature half (the target's top layer reads hidden states there) and zeros on the embedding
    half, so at step 0 it computes the target's attention over the fused features. ``hidden_norm``
    and ``input_layernorm`` both take the target's input norm. Tensors the target lacks (qwen3's
    q/k norms on a llama target) keep their initial values.
    """
    top = info.num_layers - 1
    names = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
             "self_attn.q_norm.weight", "self_attn.k_norm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
             "mlp.down_proj.weight", "input_layernorm.weight", "post_attention_layernorm.weight")
    want = {n: (f"model.layers.{top}.{n}", f"model.language_model.layers.{top}.{n}") for n in names}
    src = read_target_tensors(info.path, want)
    copied = 0
    with torch.no_grad():
        for layer in model.layers:
            params = dict(layer.named_parameters())
            for name, t in src.items():
                p = params.get(name)
                if p is None:
                    continue
                t = t.float()
                if p.shape == t.shape:
                    p.copy_(t)
                elif name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight")) and p.shape == (
                        t.shape[0], 2 * t.shape[1]):
                    p.zero_()
                    p[:, t.shape[1]:].copy_(t)
                else:
                    continue
                copied += 1
            if layer.layer_idx == 0 and "input_layernorm.weight" in src:
                if layer.hidden_norm.weight.shape == src["input_layernorm.weight"].shape:
                    layer.hidden_norm.weight.copy_(src["input_layernorm.weight"].float())
                    copied += 1
    if copied == 0:
        raise TargetError(f"draft.init_from_target_layer: no tensor of target layer {top} ({info.path}) fits the "
                          "draft's layers")
    return copied
