"""Whether a published draft may replace the one a vLLM server runs, decided before anything is loaded.

A swap loads new weights into the draft model vLLM built at start-up; whatever vLLM derived from the
start-up draft's config (the layer shapes, the target layers whose hidden states it reads, the parallel
drafting mask token, the number of depths) stays as it was. So the new draft must have the same structure
(:func:`check_fits`), the same tensors by name, shape and kind (:func:`check_tensors`), and the same
vocabulary maps; and its weights must be finite. Any difference is a :class:`SwapRefused` naming every
field or tensor that differs: such a draft needs a restart.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..errors import PeagleError
from ..model.spec import DraftSpec

# The transformer layer's settings vLLM builds the draft's modules from (the rest of the layer config,
# names and versions, does not change what runs).
STRUCTURE_KEYS = ("hidden_size", "vocab_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                  "intermediate_size", "num_hidden_layers", "rms_norm_eps", "hidden_act", "attention_bias",
                  "mlp_bias", "sliding_window", "layer_types", "rope_theta", "rope_parameters", "rope_scaling",
                  "max_position_embeddings", "tie_word_embeddings")
# The draft's own settings vLLM reads once, when it starts (speculators config and P-EAGLE fields).
SPEC_FIELDS = ("arch", "draft_vocab_size", "mask_token_id", "aux_layer_ids", "norm_before_residual",
               "norm_before_fc", "num_depths", "verifier_architectures")
# Vocabulary maps: the draft's token ids in the target's vocabulary and back. Equal, or the draft proposes
# other tokens than the running server maps (a refresh keeps the serving draft's vocabulary).
VOCAB_MAPS = ("d2t", "t2d")


class SwapRefused(PeagleError):
    """The draft may not replace the running one (it is left serving, untouched)."""


def structure(spec: DraftSpec) -> dict[str, Any]:
    """What must be equal between the running draft and its replacement."""
    return {**{f: getattr(spec, f) for f in SPEC_FIELDS},
            **{f"layer_config.{k}": spec.layer_config.get(k) for k in STRUCTURE_KEYS}}


def check_fits(running: DraftSpec, new: DraftSpec, where: str) -> None:
    """Refuse ``new`` (read from ``where``) unless its structure is the running draft's."""
    have, want = structure(running), structure(new)
    differ = [f"{k}: running {have[k]!r}, new {want[k]!r}" for k in have if have[k] != want[k]]
    if differ:
        raise SwapRefused(f"{where} is not the running draft's kind of draft (a restart serves it): "
                          + "; ".join(differ))


def check_tensors(running: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor], where: str) -> None:
    """Refuse ``new`` unless it holds the running draft's tensors (names, shapes, floating or not), equal
    vocabulary maps, and finite weights."""
    problems = []
    missing, extra = sorted(set(running) - set(new)), sorted(set(new) - set(running))
    if missing:
        problems.append(f"missing {', '.join(missing)}")
    if extra:
        problems.append(f"not in the running draft: {', '.join(extra)}")
    for name in sorted(set(running) & set(new)):
        a, b = running[name], new[name]
        if tuple(a.shape) != tuple(b.shape):
            problems.append(f"{name}: shape {tuple(b.shape)}, running {tuple(a.shape)}")
        elif a.is_floating_point() != b.is_floating_point():
            problems.append(f"{name}: dtype {b.dtype}, running {a.dtype}")
        elif name in VOCAB_MAPS and not torch.equal(a, b):
            problems.append(f"{name}: another vocabulary map than the running draft's")
    if problems:
        raise SwapRefused(f"{where} does not fit the running draft (a restart serves it): " + "; ".join(problems))
    for name, t in new.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise SwapRefused(f"{where}: tensor {name} holds NaN or infinite values")
