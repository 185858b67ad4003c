"""Offline agreement of a draft with its target on held-out hidden states (no vLLM).

Input: samples with the target's own hidden states, as the extraction stage writes them
(:class:`peagle.extract.HiddenStatesDataset`: ``input_ids`` [T], ``loss_mask`` [T],
``aux_hidden_flat`` [T, 3H], ``last_hidden`` [T, H] before the final norm), or the trainer's dict
samples (same fields, ``aux_hidden`` already [T, 3H]).

What is compared. After the one-token shift (:func:`peagle.model.elements.shift_row`) shifted row t
pairs the real token x_{t+1} with the target features g_t. The *target's* choice at row t is its
greedy token after x_{t+1}: argmax over the **full** target vocabulary of
``lm_head(final_norm(last_hidden[t+1]))``. The draft's element (anchor a, depth d) proposes
``d2t(argmax draft logits)`` for row a + d — exactly draft position d of a vLLM parallel-drafting
step whose last real token is x_{a+1}. Comparing in the full vocabulary (not the pruned draft
vocabulary the trainer's accuracy uses) means a target token the draft cannot produce counts as a
miss, as it does when vLLM verifies. Every supervised anchor is evaluated at every depth
0..K-1 whose target rows a..a+d are all supervised (no COD sampling); the draft sees the real
context up to its anchor and mask slots beyond it, as at serving time.

Figures:

* ``per_depth_agreement[d]`` — unconditional top-1 agreement at depth d: the fraction of depth-d
  elements whose proposal equals the target's token (the trainer's ``position_d_acc``, over all
  anchors and in the full vocabulary).
* ``conditional_agreement[d]`` = p_d — agreement at depth d among the chains (anchors) whose
  depths 0..d-1 all agreed: p_d = n_d / m_d with n_d = #anchors agreeing at 0..d and
  m_d = #anchors agreeing at 0..d-1 (both among anchors that have depth d). p_0 = agreement at 0.
* ``prefix_agreement[d]`` = Π_{j<=d} p_j — the probability that the first d+1 proposals all
  agree: the offline counterpart of vLLM's per-position acceptance accepted_at_pos[d] / drafts.
* The chain estimate of the acceptance length with K draft tokens::

      E[AL](K) = 1 + Σ_{k=0}^{K-1} Π_{j=0}^{k} p_j

  (the 1 is the target's bonus token; greedy verification accepts draft token k iff tokens 0..k
  all equal the target's greedy choice). Products of conditionals rather than direct prefix
  fractions keep the estimate unbiased when deep depths have fewer anchors (chains cut off by the
  end of a sample or by unsupervised rows).

Caveats (why this is an estimate, not a measurement): it is greedy top-1 agreement (sampled
decoding accepts by rejection sampling, which this does not model); every anchor is weighted
equally, while vLLM starts draft rounds only where the previous round ended; and on data that is
not the target's own output, the context after an accepted token is the data's token rather than
the target's. On the target's own greedy generations (regenerated responses) with greedy
decoding, the estimate and vLLM's measured AL describe the same quantity.
"""
from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..model import PEagleDraftModel, load_draft
from ..model.target import inspect_target, target_embedding_and_head
from ..model.elements import ShiftedRow, build_elements, shift_row
from ..model.teacher import Teacher


@dataclass
class OfflineAgreement:
    """Offline figures over a set of samples (see the module docstring for definitions)."""

    num_depths: int
    num_samples: int = 0
    num_anchors: int = 0
    per_depth_agreement: list[float | None] = field(default_factory=list)
    per_depth_count: list[int] = field(default_factory=list)
    conditional_agreement: list[float | None] = field(default_factory=list)
    prefix_agreement: list[float] = field(default_factory=list)

    def expected_acceptance_length(self, k: int | None = None) -> float:
        """Chain estimate E[AL](k) = 1 + Σ_{d<k} Π_{j<=d} p_j (k defaults to all depths)."""
        k = self.num_depths if k is None else k
        if not 1 <= k <= self.num_depths:
            raise ValueError(f"k must be in 1..{self.num_depths}, got {k}")
        return 1.0 + sum(self.prefix_agreement[:k])

    def as_dict(self) -> dict[str, Any]:
        return {
            "num_depths": self.num_depths, "num_samples": self.num_samples, "num_anchors": self.num_anchors,
            "per_depth_agreement": self.per_depth_agreement, "per_depth_count": self.per_depth_count,
            "conditional_agreement": self.conditional_agreement, "prefix_agreement": self.prefix_agreement,
            "expected_acceptance_length": {str(k): self.expected_acceptance_length(k)
                                           for k in range(1, self.num_depths + 1)},
            "estimator": "E[AL](K) = 1 + sum_{k<K} prod_{j<=k} p_j, p_j = P(depth j agrees | depths < j agree); "
                         "greedy top-1 in the full target vocabulary, every supervised anchor weighted equally",
        }


class ChainCounter:
    """Accumulates per-anchor agreement chains into the figures of :class:`OfflineAgreement`.

    Fed with an [n_anchors, K] bool ``agree`` matrix and an equally shaped ``present`` matrix
    (depth d exists for that anchor); present must be prefix-closed along each row.
    """

    def __init__(self, num_depths: int):
        self.k = num_depths
        self.correct = torch.zeros(num_depths, dtype=torch.long)
        self.count = torch.zeros(num_depths, dtype=torch.long)
        self.chain_ok = torch.zeros(num_depths, dtype=torch.long)  # n_d
        self.chain_prev = torch.zeros(num_depths, dtype=torch.long)  # m_d
        self.anchors = 0

    def add(self, agree: torch.Tensor, present: torch.Tensor) -> None:
        agree, present = agree.bool().cpu(), present.bool().cpu()
        if agree.shape != present.shape or agree.shape[-1] != self.k:
            raise ValueError(f"agree {tuple(agree.shape)} and present {tuple(present.shape)} must be [n, {self.k}]")
        hit = agree & present
        self.correct += hit.sum(0)
        self.count += present.sum(0)
        # prefix[:, d] = all of depths 0..d agreed (and exist)
        prefix = torch.cumprod(hit.long(), dim=1).bool()
        before = torch.ones_like(prefix)
        before[:, 1:] = prefix[:, :-1]
        self.chain_ok += (prefix & present).sum(0)
        self.chain_prev += (before & present).sum(0)
        self.anchors += int(present[:, 0].sum())

    def result(self, num_samples: int) -> OfflineAgreement:
        per_depth = [c / n if n else None for c, n in zip(self.correct.tolist(), self.count.tolist())]
        cond = [c / n if n else None for c, n in zip(self.chain_ok.tolist(), self.chain_prev.tolist())]
        prefix, running = [], 1.0
        for p in cond:
            running *= p if p is not None else 0.0
            prefix.append(running)
        return OfflineAgreement(self.k, num_samples, self.anchors, per_depth, self.count.tolist(), cond, prefix)


class TargetGreedy:
    """The target's greedy next token from its pre-norm last hidden state (final RMSNorm + lm_head)."""

    def __init__(self, target_dir: str | os.PathLike, device: torch.device | str = "cpu"):
        info = inspect_target(target_dir)
        _, head, norm = target_embedding_and_head(info)
        if norm is None:
            raise ValueError(f"{target_dir}: no final norm weight to rebuild the target's logits")
        # the trainer's teacher over the full target vocabulary
        self.logits = Teacher(norm, head, float(getattr(info.config, "rms_norm_eps", 1e-6))).to(device)
        self.device = torch.device(device)

    @torch.no_grad()
    def __call__(self, last_hidden: torch.Tensor, chunk: int = 256) -> torch.Tensor:
        """[n, H] -> [n] int64 token ids (argmax over the full target vocabulary)."""
        out = []
        for i in range(0, last_hidden.shape[0], chunk):
            out.append(self.logits(last_hidden[i:i + chunk].to(self.device)).argmax(-1).cpu())
        return torch.cat(out) if out else torch.zeros(0, dtype=torch.long)


def _fields(sample: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, loss_mask, aux [T, 3H], last_hidden [T, H]) of an extraction sample or a trainer dict."""
    if isinstance(sample, dict):
        aux = sample["aux_hidden"]
        return sample["input_ids"], sample["loss_mask"], aux.reshape(aux.shape[0], -1), sample["last_hidden"]
    return sample.input_ids, sample.loss_mask, sample.aux_hidden_flat, sample.last_hidden


def _chains(row: ShiftedRow, num_depths: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(anchors [n], present [n, K]): supervised anchors and which depths their chain reaches.

    Depth d exists for anchor a iff rows a..a+d are all supervised and inside the row.
    """
    t = len(row)
    ok = row.loss_mask.bool()
    anchors = ok.nonzero().squeeze(1)
    present = torch.zeros(anchors.numel(), num_depths, dtype=torch.bool)
    alive = torch.ones(anchors.numel(), dtype=torch.bool)
    for d in range(num_depths):
        rows = anchors + d
        inside = rows < t
        alive &= inside
        alive[inside] &= ok[rows[inside]]
        present[:, d] = alive
    return anchors, present


@torch.no_grad()
def sample_chains(model: PEagleDraftModel, greedy: TargetGreedy, sample: Any, num_depths: int,
                  max_elements: int = 4096, device: torch.device | str = "cpu"):
    """Per supervised anchor of one sample: (proposed [n, K], target [n, K], present [n, K]).

    ``proposed[i, d]`` is the draft's token (target vocabulary) for depth d of anchor i,
    ``target[i, d]`` the target's greedy token for the same row, ``present[i, d]`` whether that
    depth exists for the anchor (entries where it does not are -1).
    """
    ids, mask, aux, last = _fields(sample)
    n = ids.shape[0]
    if n < 2:
        empty = torch.zeros(0, num_depths, dtype=torch.long)
        return empty, empty, empty.bool()
    row = shift_row(ids.long(), aux.float(), mask, torch.zeros(n, dtype=torch.long), last)
    target_ids = greedy(row.teacher_hidden)  # [T]: the target's token for shifted row t
    anchors, present = _chains(row, num_depths)
    proposed = torch.full(present.shape, -1, dtype=torch.long)
    rows = (anchors[:, None] + torch.arange(num_depths)[None]).clamp(max=len(row) - 1)
    target = torch.where(present, target_ids[rows], torch.full_like(proposed, -1))
    spec = model.spec
    lo = 0
    while lo < anchors.numel():
        # Depth-0 context up to the chunk's last anchor + the deeper elements of the chunk's anchors.
        hi = lo + 1
        while hi < anchors.numel() and int(anchors[hi]) + 1 + (hi + 1 - lo) * (num_depths - 1) <= max_elements:
            hi += 1
        chunk = anchors[lo:hi]
        context = int(chunk[-1]) + 1
        deep_a, deep_d = [], []
        for d in range(1, num_depths):
            sel = present[lo:hi, d]
            deep_a.append(chunk[sel])
            deep_d.append(torch.full((int(sel.sum()),), d, dtype=torch.long))
        el = build_elements(row, torch.cat([torch.arange(context), *deep_a]),
                            torch.cat([torch.zeros(context, dtype=torch.long), *deep_d]))
        inputs = {k: v.to(device) for k, v in el.model_inputs(row).items()}
        masks = {k: v.to(device) for k, v in el.layer_masks(spec.layer_types, spec.sliding_window, "dense").items()}
        logits = model(**inputs, attention_mask=masks).logits[0]
        tokens = model.draft_to_target(logits.argmax(-1)).cpu()
        # Scatter element proposals back to (anchor index, depth); context rows that are not
        # anchors of this chunk are only there to be attended to.
        index_of = torch.full((len(row),), -1, dtype=torch.long)
        index_of[chunk] = torch.arange(chunk.numel())
        keep = index_of[el.anchors] >= 0
        proposed[lo + index_of[el.anchors[keep]], el.depths[keep]] = tokens[keep]
        lo = hi
    return proposed, target, present


def offline_agreement(draft: PEagleDraftModel | str | os.PathLike, target_dir: str | os.PathLike,
                      samples: Iterable[Any], *, num_depths: int | None = None, max_samples: int | None = None,
                      max_elements: int = 4096, device: str = "cpu") -> OfflineAgreement:
    """Per-depth agreement and the chain estimate of the acceptance length over ``samples``.

    draft        a loaded model or a checkpoint directory (read with :func:`peagle.model.load_draft`)
    target_dir   the target the samples were extracted from (its final norm and lm_head)
    num_depths   K to evaluate (default: the draft's trained depths; more is allowed, those depths
                 were simply never trained)
    max_elements upper bound on the elements of one draft forward (long samples are evaluated in
                 chunks of anchors, each with its full causal context)
    """
    dev = torch.device(device)
    model = draft if isinstance(draft, PEagleDraftModel) else load_draft(draft)
    model = model.to(dev).float().eval()
    k = num_depths or model.spec.num_depths
    greedy = TargetGreedy(target_dir, dev)
    counter = ChainCounter(k)
    n = 0
    for sample in samples:
        if max_samples is not None and n >= max_samples:
            break
        proposed, target, present = sample_chains(model, greedy, sample, k, max_elements, dev)
        counter.add((proposed == target) & present, present)
        n += 1
    return counter.result(n)
