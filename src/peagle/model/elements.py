"""From one packed row of target outputs to the flattened P-EAGLE element batch (what the trainer
and the offline evaluation both feed the draft).

Two steps, both for a single packed row (micro-batch 1, docs/peagle-format.md §3.5):

1. :func:`shift_row` — the one-token alignment of §3.1. Row t of the shifted row pairs the real
   token x_{t+1} with the target's aux features g_t; it is supervised by the target's distribution
   at position t+1 (teacher hidden y_{t+1}) and only where l_{t+1} = 1. Row t drafts x_{t+2}.
2. :func:`build_elements` — the element inputs of §2.2 for the (anchor, depth) list that COD
   (:mod:`peagle.train.cod`) samples: per element the token, the aux-feature row, the RoPE
   position, the document, the target row and the loss flag.

Packed rows are shifted as a whole, so the last row of every document would pair that document's
last features with the next document's first token. speculators shifts each sample before packing
and so never forms such a row; we keep the row (so the shifted row is exactly n-1 long) but mark
it as padding (document -1, not supervised), which is equivalent.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .attention_mask import dense_mask, layer_masks


@dataclass
class ShiftedRow:
    """One packed row after the §3.1 shift; every tensor has T = n - 1 rows."""

    input_ids: torch.Tensor  # [T] int64: x_{t+1}
    aux_hidden: torch.Tensor  # [T, A*H]: g_t
    loss_mask: torch.Tensor  # [T] bool: l_{t+1}; False on padding and document-boundary rows
    document_ids: torch.Tensor  # [T] int64: document of row t; -1 on padding and document-boundary rows
    teacher_hidden: torch.Tensor | None = None  # [T, H]: y_{t+1}, the target's last hidden state

    def __len__(self) -> int:
        return self.input_ids.shape[0]


def shift_row(
    input_ids: torch.Tensor,
    aux_hidden: torch.Tensor,
    loss_mask: torch.Tensor,
    document_ids: torch.Tensor,
    teacher_hidden: torch.Tensor | None = None,
) -> ShiftedRow:
    """Apply the §3.1 shift to one packed row of length n (n >= 2).

    input_ids [n], aux_hidden [n, A*H], loss_mask [n], document_ids [n] (-1 = padding),
    teacher_hidden [n, H] or None. A row t whose two source positions t and t+1 lie in different
    documents (or in padding) becomes a padding row of the result.
    """
    n = input_ids.shape[0]
    if n < 2:
        raise ValueError(f"a packed row needs at least 2 tokens to shift, got {n}")
    for name, x in (("aux_hidden", aux_hidden), ("loss_mask", loss_mask), ("document_ids", document_ids),
                    ("teacher_hidden", teacher_hidden)):
        if x is not None and x.shape[0] != n:
            raise ValueError(f"{name} has {x.shape[0]} rows, input_ids has {n}")
    docs = document_ids.long()
    same_doc = (docs[:-1] == docs[1:]) & (docs[:-1] >= 0)
    return ShiftedRow(
        input_ids=input_ids[1:].long(),
        aux_hidden=aux_hidden[:-1],
        loss_mask=loss_mask[1:].bool() & same_doc,
        document_ids=torch.where(same_doc, docs[:-1], torch.full_like(docs[:-1], -1)),
        teacher_hidden=None if teacher_hidden is None else teacher_hidden[1:],
    )


@dataclass
class Elements:
    """The flattened element batch of one shifted row; every tensor is [S].

    Element i = (anchor a, depth d). Depth-0 elements are the real rows; depth d >= 1 elements
    carry their anchor's token and feature row only as placeholders — the draft model replaces
    them by ``mask_token_id`` / ``mask_hidden`` wherever ``depths > 0``, and neither placeholder
    reveals anything beyond the anchor.
    """

    anchors: torch.Tensor  # int64
    depths: torch.Tensor  # int64
    input_ids: torch.Tensor  # int64: shifted token at the anchor (x_{a+1})
    aux_index: torch.Tensor  # int64: row of ShiftedRow.aux_hidden to feed (the anchor)
    position_ids: torch.Tensor  # int64: a + d, the RoPE position
    document_ids: torch.Tensor  # int64: document of the anchor (-1 = padding)
    target_rows: torch.Tensor  # int64: a + d; the teacher distribution is the target's at this shifted row
    loss_mask: torch.Tensor  # bool: supervised (target row supervised, same non-padding document)

    def __len__(self) -> int:
        return self.anchors.shape[0]

    def depth_counts(self, num_depths: int) -> list[int]:
        return torch.bincount(self.depths.cpu(), minlength=num_depths).tolist()

    def at_targets(self, per_row: torch.Tensor) -> torch.Tensor:
        """Gather a per-shifted-row tensor [T, ...] (teacher hidden or logits) at the target rows -> [S, ...]."""
        return per_row[self.target_rows]

    def model_inputs(self, row: ShiftedRow) -> dict[str, torch.Tensor]:
        """Keyword arguments for ``PEagleDraftModel.forward`` (batch dim 1), less ``attention_mask``."""
        return dict(
            input_ids=self.input_ids[None],
            aux_hidden=row.aux_hidden[self.aux_index][None],
            position_ids=self.position_ids[None],
            depths=self.depths[None],
        )

    def attention_mask(self, window: int | None = None) -> torch.Tensor:
        """Dense bool [S, S] P-EAGLE mask (True = may attend), §2.3."""
        return dense_mask(self.anchors, self.depths, self.document_ids, window)

    def layer_masks(self, layer_types: list[str], sliding_window: int | None, kind: str = "dense"):
        """One mask per draft layer type, in the form ``PEagleDraftModel.forward`` takes."""
        return layer_masks(layer_types, self.anchors, self.depths, self.document_ids, sliding_window, kind)


def build_elements(row: ShiftedRow, anchors: torch.Tensor, depths: torch.Tensor) -> Elements:
    """Per-element tensors for (anchors, depths), e.g. the output of :func:`peagle.train.cod.sample_cod`.

    Requires 0 <= anchor and anchor + depth < T. An element is supervised iff its target row is
    supervised and lies in the anchor's (non-padding) document.
    """
    anchors, depths = anchors.long(), depths.long()
    targets = anchors + depths
    t = len(row)
    if anchors.numel() and (int(anchors.min()) < 0 or int(targets.max()) >= t or int(depths.min()) < 0):
        raise ValueError(f"elements must satisfy 0 <= anchor, 0 <= depth, anchor + depth < {t}")
    docs = row.document_ids[anchors]
    supervised = row.loss_mask[targets] & (row.document_ids[targets] == docs) & (docs >= 0)
    return Elements(
        anchors=anchors,
        depths=depths,
        input_ids=row.input_ids[anchors],
        aux_index=anchors,
        position_ids=targets,
        document_ids=docs,
        target_rows=targets,
        loss_mask=supervised,
    )
