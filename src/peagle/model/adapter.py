"""Checkpoint adapter: PEagleDraftModel <-> speculators-format ``config.json`` + ``model.safetensors``.

This module is the only place that knows the on-disk format vLLM reads (docs/peagle-format.md §1
and its must-match list, §1.4). It has

* an explicit name map (:func:`checkpoint_tensors`): every tensor the checkpoint must hold, with
  the model parameter it comes from and its exact shape;
* a required-key check on write *and* read: a missing, unexpected or mis-shaped tensor, or a
  missing/invalid config field, is an error naming it — an incomplete checkpoint is never written;
* atomic publication: tensors first, ``config.json`` last, in a temporary directory renamed into
  place, so a reader never sees a half-written checkpoint;
* the hand-off to its consumers (evaluate, deploy, the pipeline's steps): :meth:`Draft.open` on a
  published draft (local or ``s3://``) and its :class:`DraftHeader`, read from the verified
  ``config.json`` -- nobody else reads that file as a dict;
* the reverse direction (:func:`import_tensors`, :meth:`Draft.state_dict`): checkpoint tensors back
  to the model's state dict, through the same name map and required-key check (a warm start of
  training reads a published draft this way).
"""
from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load as load_safetensors
from safetensors.torch import save_file

from ..errors import PeagleError
from ..records.identity import IDENTITY_FILES, DraftIdentity
from ..stage_io import fetched_input, staged
from ..storage import SUCCESS, ChecksumMismatchError, IncompletePrefixError, Published, open_published, open_store
from .draft import PEagleDraftModel
from .spec import SUPPORTED_DRAFT_ARCHS, DraftSpec

FORMAT_VERSION = "0.9.0"  # the speculators release whose format we write
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
DRAFT_KIND = "peagle-draft"  # the published kind of a draft checkpoint (peagle.stage_io.staged)
READ_ALIASES = {"midlayer.": "layers.0."}  # older EAGLE-3 checkpoints name layer 0 "midlayer"


class CheckpointError(PeagleError, ValueError):
    """A checkpoint is incomplete or inconsistent; the message names the field or tensor."""


# ----------------------------------------------------------------------------------------------
# The name map


def checkpoint_tensors(spec: DraftSpec) -> dict[str, tuple[str, tuple[int, ...]]]:
    """checkpoint tensor name -> (model state-dict name, shape). Names coincide by design."""
    h, v, vd, a = spec.hidden_size, spec.vocab_size, spec.draft_vocab_size, spec.num_aux
    lc = spec.layer_config
    nh, nkv, inter = lc["num_attention_heads"], lc["num_key_value_heads"], lc["intermediate_size"]
    d = lc.get("head_dim") or h // nh
    names: dict[str, tuple[int, ...]] = {
        "embed_tokens.weight": (v, h),
        "fc.weight": (h, a * h),
        "norm.weight": (h,),
        "lm_head.weight": (vd, h),
        "mask_hidden": (1, 1, a * h),
    }
    if spec.norm_before_fc:
        names["input_norm.weight"] = (a * h,)
    for i in range(spec.num_layers):
        w = 2 * h if i == 0 else h
        p = f"layers.{i}."
        names.update({
            p + "self_attn.q_proj.weight": (nh * d, w),
            p + "self_attn.k_proj.weight": (nkv * d, w),
            p + "self_attn.v_proj.weight": (nkv * d, w),
            p + "self_attn.o_proj.weight": (h, nh * d),
            p + "mlp.gate_proj.weight": (inter, h),
            p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
        })
        if i == 0:
            names[p + "hidden_norm.weight"] = (h,)
        if spec.arch == "qwen3":
            names[p + "self_attn.q_norm.weight"] = (d,)
            names[p + "self_attn.k_norm.weight"] = (d,)
    if vd < v:  # vLLM reads d2t; t2d is ignored by vLLM but kept for training tools
        names["d2t"] = (vd,)
        names["t2d"] = (v,)
    return {k: (k, shape) for k, shape in names.items()}


INTEGER_TENSORS = {"d2t": torch.int64, "t2d": torch.bool}


# ----------------------------------------------------------------------------------------------
# config.json


def spec_to_config(spec: DraftSpec, dtype: torch.dtype) -> dict[str, Any]:
    import transformers

    return {
        "architectures": ["PEagleDraftModel"],
        "draft_vocab_size": spec.draft_vocab_size,
        "dtype": str(dtype).removeprefix("torch."),
        "eagle_aux_hidden_state_layer_ids": list(spec.aux_layer_ids),
        "embed_requires_grad": True,
        "fc_norm": False,  # vLLM's peagle hook does not forward fc_norm: never train with it
        "mask_token_id": spec.mask_token_id,
        "norm_before_fc": spec.norm_before_fc,
        "norm_before_residual": spec.norm_before_residual,  # always explicit: defaults differ per tool
        "norm_output": False,
        "speculators_config": {
            "algorithm": "peagle",
            "default_proposal_method": "greedy",
            "proposal_methods": [
                {"proposal_type": "greedy", "speculative_tokens": spec.num_depths,
                 "verifier_accept_k": 1, "accept_tolerance": 0.0}
            ],
            "verifier": {"name_or_path": spec.verifier_name_or_path,
                         "architectures": list(spec.verifier_architectures)},
        },
        "speculators_model_type": "peagle",
        "speculators_version": FORMAT_VERSION,
        "target_hidden_size": None,
        "tie_word_embeddings": False,
        "transformer_layer_config": spec.layer_config,
        "transformers_version": transformers.__version__,
    }


def _require(d: dict, dotted: str, typ, where: str):
    cur: Any = d
    for part in dotted.split("."):
        if not isinstance(cur, dict) or part not in cur:
            raise CheckpointError(f"{where}: required field '{dotted}' is missing")
        cur = cur[part]
    if typ is int and (isinstance(cur, bool) or not isinstance(cur, int)):
        raise CheckpointError(f"{where}: field '{dotted}' must be an integer, got {cur!r}")
    if typ is not int and not isinstance(cur, typ):
        raise CheckpointError(f"{where}: field '{dotted}' must be {typ.__name__}, got {cur!r}")
    return cur


def config_to_spec(cfg: dict[str, Any], where: str = CONFIG_FILE) -> DraftSpec:
    """Validate a speculators P-EAGLE config against the must-match list and build its DraftSpec."""
    mt = _require(cfg, "speculators_model_type", str, where)
    if mt != "peagle":
        raise CheckpointError(f"{where}: field 'speculators_model_type' must be 'peagle', got {mt!r}")
    layer = _require(cfg, "transformer_layer_config", dict, where)
    arch = _require(cfg, "transformer_layer_config.model_type", str, where)
    if arch not in SUPPORTED_DRAFT_ARCHS:
        raise CheckpointError(
            f"{where}: field 'transformer_layer_config.model_type' must be one of {SUPPORTED_DRAFT_ARCHS}, got {arch!r}"
        )
    mask = _require(cfg, "mask_token_id", int, where)
    aux = _require(cfg, "eagle_aux_hidden_state_layer_ids", list, where)
    vd = _require(cfg, "draft_vocab_size", int, where)
    nbr = _require(cfg, "norm_before_residual", bool, where)
    sc = _require(cfg, "speculators_config", dict, where)
    _require(cfg, "speculators_config.algorithm", str, where)
    methods = _require(cfg, "speculators_config.proposal_methods", list, where)
    if not methods:
        raise CheckpointError(f"{where}: field 'speculators_config.proposal_methods' is empty")
    default = _require(cfg, "speculators_config.default_proposal_method", str, where)
    chosen = next((m for m in methods if isinstance(m, dict) and m.get("proposal_type") == default), None)
    if chosen is None:
        raise CheckpointError(
            f"{where}: 'speculators_config.default_proposal_method' {default!r} names no entry of proposal_methods"
        )
    k = chosen.get("speculative_tokens")
    if not isinstance(k, int) or k < 1:
        raise CheckpointError(f"{where}: proposal method {default!r} needs a positive integer 'speculative_tokens'")
    verifier = _require(cfg, "speculators_config.verifier.name_or_path", str, where)
    archs = sc["verifier"].get("architectures") or []
    if cfg.get("fc_norm"):
        raise CheckpointError(f"{where}: field 'fc_norm' is true; vLLM's P-EAGLE path ignores it, so it must be false")
    if cfg.get("target_hidden_size") not in (None, layer.get("hidden_size")):
        raise CheckpointError(
            f"{where}: field 'target_hidden_size' {cfg['target_hidden_size']} differs from the draft hidden size "
            f"{layer.get('hidden_size')}; drafts with a different hidden size are not supported"
        )
    try:
        return DraftSpec(
            arch=arch, layer_config=layer, draft_vocab_size=vd, mask_token_id=mask, aux_layer_ids=aux,
            norm_before_residual=nbr, norm_before_fc=bool(cfg.get("norm_before_fc", False)), num_depths=k,
            verifier_name_or_path=verifier, verifier_architectures=list(archs),
        )
    except ValueError as exc:
        raise CheckpointError(f"{where}: {exc}") from None


# ----------------------------------------------------------------------------------------------
# Write / read


def _check_tensors(spec: DraftSpec, tensors: dict[str, torch.Tensor], where: str) -> None:
    expected = checkpoint_tensors(spec)
    missing = sorted(set(expected) - set(tensors))
    extra = sorted(set(tensors) - set(expected))
    if missing:
        raise CheckpointError(f"{where}: missing tensors: {', '.join(missing)}")
    if extra:
        raise CheckpointError(f"{where}: unexpected tensors: {', '.join(extra)}")
    for name, (_, shape) in expected.items():
        got = tuple(tensors[name].shape)
        if got != shape:
            raise CheckpointError(f"{where}: tensor {name} has shape {got}, expected {shape}")


def export_tensors(model: PEagleDraftModel, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    sd = model.state_dict()
    out = {}
    for ckpt_name, (model_name, _) in checkpoint_tensors(model.spec).items():
        if model_name not in sd:
            raise CheckpointError(f"model has no parameter {model_name} (checkpoint tensor {ckpt_name})")
        t = sd[model_name].detach().to("cpu")
        t = t.to(INTEGER_TENSORS.get(ckpt_name, dtype))
        out[ckpt_name] = t.contiguous()
    return out


def save_draft(model: PEagleDraftModel, out_dir: str | os.PathLike, dtype: torch.dtype = torch.bfloat16,
               extra_files: dict[str, str] | None = None) -> Path:
    """Write a vLLM-servable checkpoint atomically. Refuses incomplete checkpoints and non-finite weights."""
    out = Path(out_dir)
    tensors = export_tensors(model, dtype)
    _check_tensors(model.spec, tensors, str(out))
    for name, t in tensors.items():  # after the cast: a float32 weight beyond the bf16 range is inf now
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise CheckpointError(f"{out}: tensor {name} holds NaN or infinite values; refusing to write a draft "
                                  "that cannot serve (did training diverge?)")
    cfg = spec_to_config(model.spec, dtype)
    config_to_spec(json.loads(json.dumps(cfg)), str(out / CONFIG_FILE))  # what we write must read back
    with staged(out, kind=DRAFT_KIND) as tmp:
        save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        for name, text in (extra_files or {}).items():
            (tmp / name).write_text(text)
        (tmp / CONFIG_FILE).write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")  # last
    return out


def _parse_config(data: bytes, where: str) -> DraftSpec:
    try:
        cfg = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{where}: not valid JSON: {exc}") from exc
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{where}: not a JSON object")
    return config_to_spec(cfg, where)


def read_spec(ckpt_dir: str | os.PathLike) -> DraftSpec:
    """The spec of the checkpoint directory ``ckpt_dir`` (published or assembled by hand)."""
    f = Path(ckpt_dir) / CONFIG_FILE
    if not f.is_file():
        raise CheckpointError(f"{ckpt_dir}: no {CONFIG_FILE} (not a checkpoint, or an unfinished write)")
    return _parse_config(f.read_bytes(), str(f))


def import_tensors(spec: DraftSpec, tensors: Mapping[str, torch.Tensor], where: str,
                   dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """The reverse of :func:`export_tensors`: checkpoint tensors -> the model's full state dict.

    Old names are read through ``READ_ALIASES``; then the required-key check (:func:`_check_tensors`,
    naming a missing, unexpected or mis-shaped tensor) and the name map. Float tensors become
    ``dtype`` (values are kept exactly when ``dtype`` is at least as wide as the stored one), d2t/t2d
    keep their integer/bool types, and a full-vocabulary draft (no d2t/t2d stored) gets the identity maps."""
    renamed = {}
    for name, t in tensors.items():
        for old, new in READ_ALIASES.items():
            if name.startswith(old):
                name = new + name[len(old):]
        renamed[name] = t
    _check_tensors(spec, renamed, where)
    state = {}
    for ckpt_name, (model_name, _) in checkpoint_tensors(spec).items():
        t = renamed[ckpt_name]
        state[model_name] = t.to(INTEGER_TENSORS[ckpt_name]) if ckpt_name in INTEGER_TENSORS else t.to(dtype)
    if spec.draft_vocab_size == spec.vocab_size:  # identity maps are not stored
        state["d2t"] = torch.zeros(spec.draft_vocab_size, dtype=torch.long)
        state["t2d"] = torch.ones(spec.vocab_size, dtype=torch.bool)
    return state


def load_draft(ckpt_dir: str | os.PathLike, dtype: torch.dtype = torch.float32) -> PEagleDraftModel:
    """Read a speculators P-EAGLE checkpoint into a model (float params in ``dtype``)."""
    d = Path(ckpt_dir)
    spec = read_spec(d)
    wf = d / WEIGHTS_FILE
    if not wf.is_file():
        raise CheckpointError(f"{d}: no {WEIGHTS_FILE}")
    with safe_open(str(wf), "pt") as fh:
        tensors = {name: fh.get_tensor(name) for name in fh.keys()}
    model = PEagleDraftModel(spec)
    model.load_state_dict(import_tensors(spec, tensors, str(wf), dtype), strict=True)
    return model.to(dtype)


# ----------------------------------------------------------------------------------------------
# The published draft: what evaluate, deploy and the pipeline open


@dataclass(frozen=True)
class DraftHeader:
    """What a published draft is, from its verified ``config.json`` and its publication."""

    arch: str
    num_layers: int
    hidden_size: int
    aux_layer_ids: tuple[int, ...]  # target layers whose hidden states the draft reads
    vocab_size: int  # the target's
    draft_vocab_size: int
    num_depths: int  # trained depths: the speculative tokens it proposes by default
    mask_token_id: int
    verifier: str  # speculators_config.verifier.name_or_path
    manifest_sha256: str  # of its _MANIFEST.json, as its _SUCCESS records: names this publication
    metadata: Mapping[str, Any] = field(repr=False)  # the publication's (kind, training step, metrics)
    spec: DraftSpec = field(repr=False)

    @classmethod
    def of(cls, spec: DraftSpec, manifest_sha256: str, metadata: Mapping[str, Any]) -> "DraftHeader":
        return cls(spec.arch, spec.num_layers, spec.hidden_size, tuple(spec.aux_layer_ids), spec.vocab_size,
                   spec.draft_vocab_size, spec.num_depths, spec.mask_token_id, spec.verifier_name_or_path,
                   manifest_sha256, dict(metadata), spec)


class Draft:
    """A published vLLM-format draft at a local path, ``file://`` or ``s3://`` URI.

    :meth:`open` checks the publication (``_SUCCESS`` matches the manifest, every file present; with
    ``deep`` every file re-hashed) and that it is a draft; :attr:`header` then reads ``config.json``
    (sha256-verified) and refuses one that is not a P-EAGLE config. :meth:`local_dir` and :meth:`load`
    give the files and the model; :meth:`publish` writes one (:func:`save_draft`).
    """

    def __init__(self, uri: str, published: Published, manifest_sha256: str):
        self.uri, self.published, self.manifest_sha256 = uri, published, manifest_sha256

    @classmethod
    def open(cls, uri: str | os.PathLike, *, deep: bool = False) -> "Draft":
        shown = str(uri)
        store = open_store(shown)
        try:
            published = open_published(store, "", deep=deep)
            sha = str(json.loads(store.get_bytes(SUCCESS))["manifest_sha256"])
        except (IncompletePrefixError, ChecksumMismatchError) as exc:
            raise CheckpointError(f"draft {shown}: {exc}") from None
        kind = published.manifest.metadata.get("kind")
        if kind not in (None, DRAFT_KIND):  # None: published by hand or by an older peagle
            raise CheckpointError(f"{shown} holds a published {kind!r}, not a {DRAFT_KIND!r}")
        for name in (CONFIG_FILE, WEIGHTS_FILE):
            if name not in published.manifest.keys:
                raise CheckpointError(f"{shown} is published but holds no {name}: not a draft")
        return cls(shown, published, sha)

    @cached_property
    def header(self) -> DraftHeader:
        where = self.published.uri_for(CONFIG_FILE)
        try:
            data = self.published.get_bytes(CONFIG_FILE)
        except ChecksumMismatchError as exc:
            raise CheckpointError(f"{where}: contents do not match the manifest's sha256 ({exc})") from None
        return DraftHeader.of(_parse_config(data, where), self.manifest_sha256, self.published.manifest.metadata)

    def local_dir(self, cache_root: str | os.PathLike | None = None) -> Path:
        """The draft's files on local disk (a remote draft is downloaded, sha256-verified, once)."""
        return fetched_input(self.uri, cache_root)

    def load(self, dtype: torch.dtype = torch.float32) -> PEagleDraftModel:
        return load_draft(self.local_dir(), dtype)

    def state_dict(self, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
        """The model state dict of this draft (:func:`import_tensors`), read from the publication itself
        (sha256-verified bytes, no local copy: every training rank may call it at once)."""
        where = self.published.uri_for(WEIGHTS_FILE)
        try:
            data = self.published.get_bytes(WEIGHTS_FILE)
        except ChecksumMismatchError as exc:
            raise CheckpointError(f"{where}: contents do not match the manifest's sha256 ({exc})") from None
        return import_tensors(self.header.spec, load_safetensors(data), where, dtype)

    @cached_property
    def identity(self) -> DraftIdentity:
        """What this draft is (:mod:`peagle.records.identity`), from its manifest's sums of its weights and config."""
        return DraftIdentity.of_sums({name: self.published.manifest[name].sha256 for name in IDENTITY_FILES})

    @property
    def fingerprint(self) -> str:
        """The draft's digest (:attr:`identity`): what gate and evaluate reports record as its ``sha256``."""
        return self.identity.digest

    @classmethod
    def publish(cls, model: PEagleDraftModel, out: str | os.PathLike, dtype: torch.dtype = torch.bfloat16,
                extra_files: dict[str, str] | None = None) -> "Draft":
        return cls.open(save_draft(model, out, dtype, extra_files))
