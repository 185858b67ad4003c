"""A vLLM weight-transfer engine that swaps the draft for a published one: backend ``peagle-draft``.

vLLM 0.32's worker drives a weight update as ``start_draft_weight_update`` -> ``update_weights(update_info)``
-> ``finish_weight_update`` (``vllm/v1/worker/gpu_worker.py``, which the CPU worker inherits), each a
``collective_rpc`` that the engine core runs between two engine steps: no step sees half a draft. The
server starts with ``--weight-transfer-config '{"backend": "peagle-draft"}'``; the project's vLLM plugin
registers this class under that name in every vLLM process (``peagle.vllm_plugin``).

``update_weights({"uri": ..., "fingerprint": ...})`` swaps in one call, all or nothing:

1. read the draft: :meth:`peagle.model.Draft.open` checks the publication (``_SUCCESS`` against the
   manifest), its config and weights are read as sha256-verified bytes (local path or ``s3://``; credentials
   from the environment); a ``fingerprint`` given must be the draft's;
2. check it against the running draft (:mod:`peagle.swap.checks`): same structure, same tensors by name,
   shape and kind, same vocabulary maps, finite weights. Where the running draft shares the target's
   embedding or lm_head (vLLM shares a draft module equal to the target's, to save memory), the new draft's
   must equal the target's too: loading it would write into the target;
3. load it through vLLM's layerwise reload (``initialize_layerwise_reload`` -> the draft model's
   ``load_weights`` -> ``finalize_layerwise_reload``), which restores each layer's checkpoint-format
   parameters and runs its post-load processing again: on CPU the linear layers' weights are repacked
   (vLLM keeps only the packed copy), on GPU copied into the kernel tensors;
4. if loading fails, the running draft's own tensors (kept since it was loaded) are loaded back the same
   way, and the error is raised: the old draft keeps serving.

Steps 1 and 2 refuse before the model is touched (:class:`~peagle.swap.checks.SwapRefused`). What serves
is kept as :attr:`PublishedDraftEngine.serving`; its fingerprint is what a caller confirms the swap by: the
worker extension :class:`DraftSwapWorker` answers ``collective_rpc("peagle_draft_fingerprint")``.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import load_file
from vllm.distributed.weight_transfer.base import (WeightTransferEngine, WeightTransferInitInfo,
                                                   WeightTransferUpdateInfo)

from ..model.adapter import WEIGHTS_FILE, CheckpointError, Draft, read_spec
from ..model.spec import DraftSpec
from ..records.identity import identify_draft
from .checks import SwapRefused, check_fits, check_tensors

log = logging.getLogger("peagle.swap")
BACKEND = "peagle-draft"
# checkpoint tensor prefix -> the draft model's module vLLM may replace by the target's own
SHAREABLE = {"embed_tokens.": "model.embed_tokens", "lm_head.": "lm_head"}


@dataclass
class DraftSwapInit(WeightTransferInitInfo):
    """Nothing to set up: the draft is read from storage when asked for."""


@dataclass
class DraftSwapUpdate(WeightTransferUpdateInfo):
    uri: str  # the published draft: a local path, file:// or s3:// URI
    fingerprint: str = ""  # the draft's fingerprint (12 hex digits) the caller expects; "": any


@dataclass(frozen=True)
class ServedDraft:
    """A draft as loaded into the worker: where from, its spec, its checkpoint tensors, its fingerprint."""

    where: str
    spec: DraftSpec
    tensors: dict[str, torch.Tensor]
    fingerprint: str


def read_published(uri: str) -> ServedDraft:
    """A published draft, every byte checked against its manifest."""
    draft = Draft.open(uri)
    data = draft.published.get_bytes(WEIGHTS_FILE)
    return ServedDraft(uri, draft.header.spec, load_safetensors(data), draft.identity.fingerprint)


def read_start_up(path: str) -> ServedDraft:
    """The draft vLLM started with (its directory, a publication copied there or files put by hand)."""
    try:
        return read_published(path)
    except CheckpointError:
        return ServedDraft(path, read_spec(path), load_file(str(Path(path) / WEIGHTS_FILE)),
                           identify_draft(path).fingerprint)


class PublishedDraftEngine(WeightTransferEngine[DraftSwapInit, DraftSwapUpdate]):
    """See the module docstring. One per worker; the target model is the engine's default target."""

    init_info_cls = DraftSwapInit
    update_info_cls = DraftSwapUpdate
    supports_draft_weight_update = True

    def __init__(self, config, vllm_config, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        spec = getattr(vllm_config, "speculative_config", None)
        draft_config = getattr(spec, "draft_model_config", None)
        # where the draft vLLM started with lives: read (once) when first asked which draft serves
        self.start_up = str(draft_config.model) if draft_config is not None else None
        self.serving: ServedDraft | None = None
        self.swaps = 0

    def init_transfer_engine(self, init_info: DraftSwapInit) -> None:
        pass

    def start_weight_update(self) -> None:
        if self.model is self._default_model:
            raise RuntimeError(f"the {BACKEND} weight-transfer engine swaps the draft only: call "
                               "start_draft_weight_update")

    def finish_weight_update(self) -> None:
        pass

    def shutdown(self) -> None:
        pass

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class synchronises torch.accelerator after loading; the swap loads synchronously, and a
        # CPU worker has no accelerator to synchronise.
        self.receive_weights(self.parse_update_info(update_info))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def receive_weights(self, update_info: DraftSwapUpdate) -> None:
        draft, target = self.model, self._default_model
        running = self.serving_draft()
        new = read_published(update_info.uri)
        if update_info.fingerprint and new.fingerprint != update_info.fingerprint:
            raise SwapRefused(f"{update_info.uri} is draft {new.fingerprint}, not {update_info.fingerprint}")
        check_fits(running.spec, new.spec, update_info.uri)
        check_tensors(running.tensors, new.tensors, update_info.uri)
        tensors = without_shared(draft, target, new.tensors, update_info.uri)
        try:
            self._load(tensors)
        except Exception as exc:
            log.error("peagle: loading draft %s failed (%s); loading the running draft %s back", new.fingerprint,
                      exc, running.fingerprint)
            self._load(without_shared(draft, target, running.tensors, running.where))
            raise
        self.serving, self.swaps = new, self.swaps + 1
        log.info("peagle: draft %s swapped in for %s (%s)", new.fingerprint, running.fingerprint, new.where)

    def serving_draft(self) -> ServedDraft:
        """The draft now loaded (read from the start-up directory the first time)."""
        if self.serving is None:
            if self.start_up is None:
                raise SwapRefused("this server serves no draft (no speculative config): nothing to swap")
            self.serving = read_start_up(self.start_up)
        return self.serving

    def _load(self, tensors: dict[str, torch.Tensor]) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

        initialize_layerwise_reload(self.model)
        try:
            self.model.load_weights(iter(tensors.items()))
        finally:
            finalize_layerwise_reload(self.model, self.model_config)


def without_shared(draft: torch.nn.Module, target: torch.nn.Module, tensors: dict[str, torch.Tensor],
                   where: str) -> dict[str, torch.Tensor]:
    """``tensors`` less those of modules the draft shares with the target, which must equal the target's."""
    target_modules = {id(m) for m in target.modules()}
    out = dict(tensors)
    for prefix, module_name in SHAREABLE.items():
        try:
            module = draft.get_submodule(module_name)
        except AttributeError:
            continue
        if id(module) not in target_modules:
            continue
        for name in [n for n in tensors if n.startswith(prefix)]:
            have = getattr(module, name[len(prefix):], None)
            new = tensors[name]
            if isinstance(have, torch.Tensor) and have.ndim == new.ndim and have.shape[0] >= new.shape[0]:
                have = have[:new.shape[0]]  # vLLM pads a vocabulary-sized table to a multiple of 64 rows
            if (not isinstance(have, torch.Tensor) or tuple(have.shape) != tuple(new.shape)
                    or not torch.equal(have.detach().cpu(), new.to(have.dtype))):
                raise SwapRefused(f"{where}: the running draft shares the target's {module_name} (it equalled the "
                                  f"target's when vLLM loaded it) and this draft's {name} differs: loading it would "
                                  "change the target; a restart serves it")
            del out[name]
    return out


def worker_fingerprint(worker=None) -> str | None:
    """For ``collective_rpc``: the fingerprint of the draft this worker serves (None: not a peagle-draft
    engine, or no draft)."""
    engine = getattr(worker, "weight_transfer_engine", None)
    if not isinstance(engine, PublishedDraftEngine) or worker.get_draft_model() is None:
        return None
    return engine.serving_draft().fingerprint


class DraftSwapWorker:
    """A vLLM worker extension (``--worker-extension-cls peagle.swap.engine.DraftSwapWorker``): the worker
    answers ``collective_rpc("peagle_draft_fingerprint")`` and ``collective_rpc("peagle_swap_draft")`` -- by
    name, so a server needs no pickled callables."""

    def peagle_draft_fingerprint(self) -> str | None:
        return worker_fingerprint(self)

    def peagle_swap_draft(self, uri: str, fingerprint: str = "") -> dict[str, str | None]:
        """The draft update session in one call: ``start_draft_weight_update`` -> ``update_weights`` ->
        ``finish_weight_update``, as the engine client's three calls would run them, then the draft now
        serving. One RPC, so the engine core runs it between two steps once: under load each RPC waits for the
        step in progress (seconds, on a CPU prefill), and the three calls plus asking before and after cost
        up to five of those waits. A failed update ends the session itself (the worker's ``update_weights``)."""
        previous = worker_fingerprint(self)
        self.start_draft_weight_update()
        self.update_weights({"uri": uri, "fingerprint": fingerprint})
        self.finish_weight_update()
        return {"previous": previous, "fingerprint": worker_fingerprint(self)}
