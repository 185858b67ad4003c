"""Warm start (``train.init_from``): a run starts from a published draft's weights instead of a fresh init.

The refresh of a serving draft (:mod:`peagle.refresh.steps`) trains its candidate this way: the run
starts from every weight of the serving draft exactly as published (bf16 values in float32), and keeps
its draft vocabulary (d2t/t2d, hence the frozen ``lm_head`` rows, which the teacher uses too), so the
candidate proposes from the same vocabulary the serving draft does. The configured draft must be the
init draft's shape exactly: :func:`check_same_draft` names every field that differs, with both values,
before any weight is read.

A resume of the run itself wins: the loop still builds the warm-started model (so the init draft must
still be there; the teacher's vocabulary comes from it), then loads the checkpoint over it, and refuses
a checkpoint of a run that started from another draft or from a fresh init (:func:`check_resumed_init`).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import torch

from ..config import ConfigError
from ..model import CheckpointError, Draft, PEagleDraftModel
from ..model.spec import DraftSpec
from .checkpoint import ResumeError
from .distributed import DistEnv, all_gather_objects

# transformer_layer_config keys that describe the file that wrote it, not the draft
BOOKKEEPING_KEYS = frozenset({"transformers_version", "dtype", "torch_dtype", "use_cache"})


@dataclass(frozen=True)
class InitDraft:
    """The draft a run starts from: where it is and which one it is (its weights are read by :meth:`model`)."""

    uri: str
    fingerprint: str  # Draft.fingerprint: the draft_fingerprint served traffic records
    draft: Draft = field(repr=False)

    def record(self) -> dict[str, str]:
        """What checkpoints and the final draft's metadata record under ``init_from``."""
        return {"uri": self.uri, "fingerprint": self.fingerprint, "manifest_sha256": self.draft.manifest_sha256}

    def model(self, spec: DraftSpec) -> PEagleDraftModel:
        """A draft of the run's ``spec`` holding exactly the init draft's weights (float32), vocabulary maps
        included; every rank reads the (sha256-verified) publication itself."""
        try:
            state = self.draft.state_dict(torch.float32)
        except CheckpointError as exc:
            raise ConfigError(f"train.init_from={self.uri}: {exc}") from None
        model = PEagleDraftModel(spec)
        model.load_state_dict(state, strict=True)
        return model


def draft_fields(spec: DraftSpec) -> dict[str, Any]:
    """The fields two drafts must share for one to continue the other, by the name a user sets them with
    (``draft.*``; ``transformer_layer_config.*`` for the decoder fields derived from the target).
    The verifier's path is left out: the same target may live elsewhere now."""
    fields: dict[str, Any] = {
        "draft.arch": spec.arch,
        "draft.num_layers": spec.num_layers,
        "draft.num_depths": spec.num_depths,
        "draft.draft_vocab_size": spec.draft_vocab_size,
        "draft.aux_layer_ids": list(spec.aux_layer_ids),
        "draft.mask_token_id": spec.mask_token_id,
        "draft.norm_before_residual": spec.norm_before_residual,
        "draft.norm_before_fc": spec.norm_before_fc,
        "hidden size": spec.hidden_size,
        "vocabulary size": spec.vocab_size,
        "target architectures": list(spec.verifier_architectures),
    }
    covered = {"model_type", "num_hidden_layers", "hidden_size", "vocab_size"} | BOOKKEEPING_KEYS
    layer = json.loads(json.dumps(spec.layer_config))  # as config.json holds it (tuples are lists there)
    fields.update({f"transformer_layer_config.{k}": v for k, v in layer.items() if k not in covered})
    return fields


def check_same_draft(init: DraftSpec, run: DraftSpec, where: str) -> None:
    """ConfigError naming every field in which the configured draft ``run`` differs from ``init``."""
    a, b = draft_fields(init), draft_fields(run)

    def shown(fields: dict[str, Any], key: str) -> str:
        return repr(fields[key]) if key in fields else "not set"

    diff = [f"{k} (init draft: {shown(a, k)}, this run: {shown(b, k)})"
            for k in sorted(set(a) | set(b), key=lambda k: (k.startswith("transformer_layer_config."), k))
            if a.get(k) != b.get(k) or (k in a) != (k in b)]
    if diff:
        raise ConfigError(f"{where}: the draft to start from differs from the configured draft in "
                          f"{'; '.join(diff)}. "
                          "A warm start continues that draft: configure the draft (draft.*) and target as it "
                          "was trained")


def open_init_draft(uri: str, spec: DraftSpec, env: DistEnv) -> InitDraft:
    """The published draft at ``uri`` (any store URI), checked against the configured ``spec``."""
    where = f"train.init_from={uri}"
    try:
        draft = Draft.open(uri)
        check_same_draft(draft.header.spec, spec, where)
        fingerprint = draft.fingerprint if env.is_main else None
    except CheckpointError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    return InitDraft(uri, all_gather_objects(fingerprint, env)[0], draft)


def check_resumed_init(state: dict[str, Any], init: InitDraft | None, where: str) -> None:
    """A checkpoint (its ``trainer_state``) continues this run only if it started from the same draft."""
    was = (state.get("init_from") or {}).get("fingerprint")
    now = init.fingerprint if init else None
    if was != now:
        def name(rec: dict | None) -> str:
            return f"draft {rec['uri']} (fingerprint {rec['fingerprint'][:12]})" if rec else "a fresh init"

        raise ResumeError(f"{where}: the checkpoint's run started from {name(state.get('init_from'))}, this run "
                          f"from {name(init.record() if init else None)} (train.init_from); use another "
                          "train.output")
