"""Drafts for the draft-swap tests (issue #41): two that tell themselves apart by acceptance, and a damaged copy."""
from __future__ import annotations

import shutil
from collections import Counter
from pathlib import Path

import torch

from peagle.config import DraftSettings
from peagle.model import init_draft
from peagle.model.adapter import Draft
from support.ladder import LADDER_DRAFT

#: token-id prompts the drafts are built for (their two most generated tokens are the draft vocabulary)
PROMPTS = [[100 + i, 200 + 3 * i, 300 + 7 * i, 50 + i, 60] for i in range(6)]


def two_token_drafts(target: Path, root: Path, prompts: list[list[int]] = PROMPTS) -> tuple[Path, Path]:
    """Drafts A and B that tell themselves apart by acceptance, of one spec: a draft vocabulary of the two
    tokens the target generates most from ``prompts``, and lm_head rows (v, -v) in A, (-v, v) in B, so
    that wherever A proposes one of the two tokens B proposes the other. Embeddings of their own (the
    target's plus noise, as a trained draft's), so vLLM does not share the target's with them."""
    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32)
    counts = Counter()
    with torch.no_grad():
        for p in prompts:
            out = lm.generate(torch.tensor([p]), max_new_tokens=24, do_sample=False, min_new_tokens=24)
            counts.update(out[0, len(p):].tolist())
    model = init_draft(str(target), DraftSettings(**LADDER_DRAFT, draft_vocab_size=2, init_seed=3),
                       dict(counts.most_common(2)))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        model.embed_tokens.weight.add_(0.01 * torch.randn(model.embed_tokens.weight.shape, generator=g))
        v = torch.randn(model.lm_head.weight.shape[1], generator=g)
        model.lm_head.weight.copy_(torch.stack([v, -v]))
        a = Path(Draft.publish(model, root / "a").uri)
        model.lm_head.weight.copy_(torch.stack([-v, v]))
        b = Path(Draft.publish(model, root / "b").uri)
    return a, b




def damaged_copy(draft: Path, out: Path) -> Path:
    """A copy of the published ``draft`` with one flipped byte in its weights: its manifest no longer matches."""
    damaged = Path(shutil.copytree(draft, out))
    weights = damaged / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-8] ^= 0xFF
    weights.write_bytes(bytes(data))
    return damaged
