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
    with torch.no_grad():
        model.embed_tokens.weight.copy_(embed.float())
        model.lm_head.weight.copy_(head.float()[t2d])
        model.d2t.copy_(d2t)
        model.t2d.copy_(t2d)
    return model
