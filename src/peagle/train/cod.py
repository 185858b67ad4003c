"""COD (Conditional Drop-token) sampling of P-EAGLE training elements (docs/peagle-format.md §3.2).

A P-EAGLE training step runs the draft once over a flattened list of *elements* (anchor a, depth d).
Depth 0 is every row of the (shifted, §3.1) packed sequence. A depth-d element (d >= 1) asks the
draft for the token d rows beyond what the depth-0 element at ``a`` drafts, seeing only the context
up to ``a`` plus its own chain (a, 1..d-1); it is supervised at *target row* ``a + d``.

Rule, for seeds S (supervised rows, at most ``max_anchors`` of them drawn without replacement):

* ``size_d = floor(max(0, |S| - d) * max(ratio**d, ratio_min))``; the loop stops at the first
  ``size_d <= 0``;
* the pool of depth 1 is S; ``size_d`` target rows are drawn from the pool without replacement
  (the whole pool when it is smaller), sorted, and become depth-d elements with anchor
  ``target - d``;
* the pool of depth d+1 is {target + 1} restricted to rows that are still eligible.

So every chain is conditional: (a, d) exists only if (a, d-1) does, and only if rows a+1..a+d are
all supervised. Sizes are relative to |S|, not to T, and deep depths are capped both by the ratio
and by how many chains survived.

Deliberate differences from speculators 0.9.0 (which this does not copy):

* No wrap-around. speculators forms the next pool with ``(p + 1) mod T`` and drops only 0; here
  ``p + 1 >= T`` is simply dropped, which is the same set of rows.
* Row 0 is never a seed. In speculators a supervised row 0 yields a depth-1 element with anchor
  -1, which indexes the last row of the sequence; here row 0 cannot be a target of a depth >= 1
  element (there is no row before it to anchor on), so anchors are never negative. |S| (and
  hence every ``size_d``) is one smaller than speculators' only when row 0 is supervised, which a
  sample with any prompt never is.
* Optional ``document_ids``: when given, a row is eligible only if it belongs to the same
  (non-padding) document as the row before it, so a chain never crosses a packing boundary and
  never anchors on padding. speculators checks only the loss mask (chains "almost never" cross
  because every document starts with an unsupervised prompt); without ``document_ids`` this
  sampler behaves the same way.
* Randomness comes only from the ``generator`` argument (one per rank), never the global RNG.
  The random stream is not meant to reproduce speculators' draws, only their distribution.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch

from ..model.elements import Elements, ShiftedRow, build_elements

DEFAULT_RATIO = 0.7
DEFAULT_RATIO_MIN = 0.2
DEFAULT_MAX_ANCHORS = 512


class CodElements(NamedTuple):
    """The sampled elements, depth-major; within one depth sorted by anchor (= by target row).

    anchors [S] int64, 0 <= anchor; depths [S] int64 in 0..K-1; anchor + depth < T.
    The first T elements are depth 0 with anchors 0..T-1.
    """

    anchors: torch.Tensor
    depths: torch.Tensor

    def depth_counts(self, num_depths: int) -> list[int]:
        """Number of elements at each depth 0..num_depths-1 (zeros for depths that were not reached)."""
        return torch.bincount(self.depths.cpu(), minlength=num_depths).tolist()


def cod_depth_size(num_seeds: int, depth: int, ratio: float = DEFAULT_RATIO,
                   ratio_min: float = DEFAULT_RATIO_MIN) -> int:
    """How many depth-``depth`` elements COD asks for (before capping by the surviving pool)."""
    return math.floor(max(0, num_seeds - depth) * max(ratio ** depth, ratio_min))


def chain_eligible_rows(loss_mask: torch.Tensor, document_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Bool [T]: rows that may be the target row of a depth >= 1 element.

    A row qualifies when it is supervised, is not row 0, and (with ``document_ids``) lies in the
    same non-padding document as the row before it.
    """
    ok = loss_mask.reshape(-1).bool().clone()
    ok[:1] = False
    if document_ids is not None:
        docs = document_ids.reshape(-1)
        if docs.shape != ok.shape:
            raise ValueError(f"document_ids has shape {tuple(docs.shape)}, loss_mask has {tuple(ok.shape)}")
        ok[1:] &= (docs[1:] == docs[:-1]) & (docs[1:] >= 0)
    return ok


def _draw_sorted(pool: torch.Tensor, k: int, generator: torch.Generator) -> torch.Tensor:
    """``k`` entries of the sorted 1-D ``pool`` drawn uniformly without replacement, re-sorted."""
    if pool.numel() <= k:
        return pool
    order = torch.randperm(pool.numel(), generator=generator, device=generator.device)[:k].cpu()
    return pool[order].sort().values


def sample_cod(
    loss_mask: torch.Tensor,
    num_depths: int,
    generator: torch.Generator,
    *,
    ratio: float = DEFAULT_RATIO,
    ratio_min: float = DEFAULT_RATIO_MIN,
    max_anchors: int | None = DEFAULT_MAX_ANCHORS,
    document_ids: torch.Tensor | None = None,
) -> CodElements:
    """Sample P-EAGLE elements for one shifted packed row of length T = ``loss_mask.numel()``.

    loss_mask     [T] (bool or 0/1) the shifted loss flags: row t supervised iff l_{t+1} = 1.
    num_depths    K >= 1; depth 0 plus up to K-1 rollout depths.
    generator     the only source of randomness (seed it per rank and step as you like).
    ratio, ratio_min, max_anchors  r, r_min and M of §3.2 (``max_anchors=None``: no cap).
    document_ids  optional [T] document id per shifted row (-1 = padding); see the module notes.

    Returns :class:`CodElements` on ``loss_mask``'s device. Sampling itself runs on the CPU.
    """
    if loss_mask.dim() != 1:
        raise ValueError(f"loss_mask must be 1-D [T], got shape {tuple(loss_mask.shape)}")
    if num_depths < 1:
        raise ValueError(f"num_depths must be >= 1, got {num_depths}")
    if not 0.0 < ratio <= 1.0 or not 0.0 <= ratio_min <= 1.0:
        raise ValueError(f"ratio must be in (0, 1] and ratio_min in [0, 1], got {ratio}, {ratio_min}")
    if max_anchors is not None and max_anchors < 1:
        raise ValueError(f"max_anchors must be >= 1 or None, got {max_anchors}")

    device = loss_mask.device
    t = loss_mask.numel()
    eligible = chain_eligible_rows(loss_mask.detach().cpu(),
                                   None if document_ids is None else document_ids.detach().cpu())
    seeds = eligible.nonzero().squeeze(1)
    if max_anchors is not None:
        seeds = _draw_sorted(seeds, max_anchors, generator)

    anchors = [torch.arange(t)]
    depths = [torch.zeros(t, dtype=torch.long)]
    pool = seeds  # candidate target rows for the current depth, sorted
    for d in range(1, num_depths):
        size = cod_depth_size(seeds.numel(), d, ratio, ratio_min)
        if size <= 0 or pool.numel() == 0:
            break
        targets = _draw_sorted(pool, size, generator)
        anchors.append(targets - d)
        depths.append(torch.full_like(targets, d))
        # A chain continues one row further only if that row exists and is itself eligible.
        nxt = targets + 1
        nxt = nxt[nxt < t]
        pool = nxt[eligible[nxt]]
    return CodElements(torch.cat(anchors).to(device), torch.cat(depths).to(device))


def sample_elements(
    row: ShiftedRow,
    num_depths: int,
    generator: torch.Generator,
    *,
    ratio: float = DEFAULT_RATIO,
    ratio_min: float = DEFAULT_RATIO_MIN,
    max_anchors: int | None = DEFAULT_MAX_ANCHORS,
) -> Elements:
    """COD-sample (document-aware) and build the elements of one shifted row."""
    cod = sample_cod(row.loss_mask, num_depths, generator, ratio=ratio, ratio_min=ratio_min,
                     max_anchors=max_anchors, document_ids=row.document_ids)
    return build_elements(row, cod.anchors, cod.depths)
