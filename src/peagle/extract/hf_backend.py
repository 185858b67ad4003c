"""Reference backend: the target's hidden states from transformers, with vLLM's layer-id semantics.

* aux id k  -> ``output_hidden_states[k]``: the residual stream entering decoder layer k.
* last id n -> the last decoder layer's output *before* the final norm. transformers'
  ``output_hidden_states[n]`` is taken after the norm, so the value is captured with a forward
  pre-hook on the final norm (its input is exactly the pre-norm residual stream).

Rows are batched by similar length and right-padded: with causal attention, padding after a
sample's last token cannot influence the sample's positions, and position ids stay 0..T-1.
Custom modelling code is never executed (``trust_remote_code=False``).
"""
from __future__ import annotations

import logging
from pathlib import Path

import torch

from .errors import ExtractError
from .rows import ExtractRow, CapturedHiddenStates
from .settings import LayerIds

log = logging.getLogger(__name__)

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


class HfHiddenStatesExtractor:
    """Loads the target's decoder stack (no lm_head) once; :meth:`extract` maps rows to hidden states."""

    def __init__(self, target: str | Path, layer_ids: LayerIds, dtype: str, batch_size: int = 8,
                 device: str = "auto"):
        from transformers import AutoModel

        self.layer_ids = layer_ids
        self.batch_size = batch_size
        self.device = _resolve_device(device)
        self.dtype = DTYPES[dtype]
        from transformers.utils import logging as hf_logging

        # AutoModel = the bare decoder (embeddings, layers, final norm): no lm_head, no logits. Its load
        # report would warn that lm_head.weight is unused (expected); check missing weights ourselves.
        verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()
        try:
            self.model, loading = AutoModel.from_pretrained(str(target), dtype=self.dtype, trust_remote_code=False,
                                                            output_loading_info=True)
        finally:
            hf_logging.set_verbosity(verbosity)
        if loading.get("missing_keys"):
            raise ExtractError(f"{target}: weights missing for {sorted(loading['missing_keys'])[:5]} ...")
        self.model.to(self.device).eval()
        num_layers = int(self.model.config.num_hidden_layers)
        if layer_ids.last != num_layers:
            raise ExtractError(f"last layer id {layer_ids.last} != the target's num_hidden_layers {num_layers}")
        self.final_norm = getattr(self.model, "norm", None)
        if not isinstance(self.final_norm, torch.nn.Module):
            raise ExtractError(f"{type(self.model).__name__} has no final `norm` module to capture the pre-norm output")
        self._pre_norm: torch.Tensor | None = None
        self.final_norm.register_forward_pre_hook(self._capture_pre_norm)

    def _capture_pre_norm(self, module, args) -> None:
        self._pre_norm = args[0]

    @torch.inference_mode()
    def _forward(self, rows: list[ExtractRow]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        longest = max(r.num_tokens for r in rows)
        ids = torch.zeros(len(rows), longest, dtype=torch.long)
        attention = torch.zeros(len(rows), longest, dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, : r.num_tokens] = torch.tensor(r.input_ids)
            attention[i, : r.num_tokens] = 1
        self._pre_norm = None
        out = self.model(input_ids=ids.to(self.device), attention_mask=attention.to(self.device),
                         output_hidden_states=True, use_cache=False)
        if self._pre_norm is None:
            raise ExtractError("the final norm was not called during the forward pass; cannot capture the last layer")
        aux = torch.stack([out.hidden_states[k] for k in self.layer_ids.aux], dim=2)  # [B, L, 3, H]
        last = self._pre_norm
        self._pre_norm = None
        # copy=True: own storage per sample, so the padded batch tensors can be freed
        return [(aux[i, : r.num_tokens].to("cpu", copy=True), last[i, : r.num_tokens].to("cpu", copy=True))
                for i, r in enumerate(rows)]

    def extract(self, rows: list[ExtractRow]) -> list[CapturedHiddenStates]:
        """Hidden states of ``rows``, returned in the order given."""
        order = sorted(range(len(rows)), key=lambda i: rows[i].num_tokens)  # less padding per batch
        results: dict[int, CapturedHiddenStates] = {}
        for start in range(0, len(order), self.batch_size):
            idx = order[start : start + self.batch_size]
            for i, (aux, last) in zip(idx, self._forward([rows[i] for i in idx])):
                results[i] = CapturedHiddenStates(rows[i], aux, last)
        return [results[i] for i in range(len(rows))]

    def close(self) -> None:
        del self.model
