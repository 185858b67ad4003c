"""The on-disk format of one hidden-state shard (safetensors, many samples per file).

Tensors (N = tokens of all samples in the shard, S = samples, H = hidden size)::

    aux_hidden   [N, 3, H]   bfloat16, or float8_e4m3fn when storage_dtype is fp8
    last_hidden  [N, H]      same dtype as aux_hidden
    aux_scale    [N, 3]      float32, fp8 only: value = aux_hidden.float() * aux_scale[..., None]
    last_scale   [N]         float32, fp8 only
    token_ids    [N]         int32
    loss_mask    [N]         uint8 (1 = supervised)
    offsets      [S + 1]     int64: sample i is rows offsets[i]:offsets[i+1]

safetensors metadata (strings): ``format`` (:data:`FORMAT`), ``sample_ids`` (JSON list, S entries)
and ``header`` (JSON of :class:`DatasetHeader`), so a lone shard still says what it holds.

fp8: each (token, layer) vector is scaled by amax/448 (448 = largest float8_e4m3fn) before the
cast, so every vector uses the full fp8 range; the scale is kept in float32. Rounding error is then
at most 2**-4 of a value (3 mantissa bits) plus 2**-10 * scale for values in the subnormal range.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from .errors import ExtractError
from .rows import CapturedHiddenStates

FORMAT = "peagle.hidden_states/v1"
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
STORAGE_DTYPES = {"bfloat16": torch.bfloat16, "fp8": torch.float8_e4m3fn}


@dataclass(frozen=True)
class DatasetHeader:
    """What every shard of one extraction shares; written into each shard, its record and the manifest."""

    layer_ids: list[int]  # aux ids then the last layer id, the order of the stored layers
    hidden_size: int
    num_hidden_layers: int
    target_fingerprint: str
    target_model_type: str
    compute_dtype: str
    storage_dtype: str
    backend: str
    format: str = FORMAT
    layer_semantics: str = field(
        default="aux id k: residual stream entering decoder layer k (transformers output_hidden_states[k]); "
        "last id n = num_hidden_layers: last decoder layer output before the final norm"
    )

    @property
    def aux_layer_ids(self) -> list[int]:
        return list(self.layer_ids[:-1])

    @property
    def last_layer_id(self) -> int:
        return int(self.layer_ids[-1])

    @property
    def stored_bytes_per_token(self) -> int:
        """Bytes one token's hidden states take in a shard: every stored layer at the storage dtype
        (fp8 adds a float32 scale per token and layer)."""
        if self.storage_dtype == "fp8":
            return len(self.layer_ids) * (self.hidden_size + 4)
        return len(self.layer_ids) * self.hidden_size * 2

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "DatasetHeader":
        """The header a trusted record holds (a verified manifest, an engine job written by peagle)."""
        known = {k: d[k] for k in cls.__dataclass_fields__ if k in d}
        return cls(**known)

    @classmethod
    def parse(cls, d: Any, where: str) -> "DatasetHeader":
        """The header ``d`` read from an object peagle may not have written (``where`` names it):
        anything that is not a header of :data:`FORMAT` shards raises :class:`ExtractError` naming
        the first bad field."""
        d = d if isinstance(d, dict) else {}
        layer_ids, hidden = d.get("layer_ids"), d.get("hidden_size")
        if d.get("format") != FORMAT:
            bad = "format"
        elif not (isinstance(layer_ids, list) and len(layer_ids) >= 2 and all(_is_count(i) for i in layer_ids)):
            bad = "layer_ids"
        elif not (_is_count(hidden) and hidden > 0):
            bad = "hidden_size"
        elif d.get("storage_dtype") not in STORAGE_DTYPES:
            bad = "storage_dtype"
        else:
            bad = next((k for k in ("num_hidden_layers", "target_fingerprint", "target_model_type", "compute_dtype",
                                    "backend", "layer_semantics") if k not in d), "")
        if bad:
            raise ExtractError(f"{where} has no valid {bad}: not a header of {FORMAT} shards")
        return cls.from_dict(d)


def _is_count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


@dataclass
class ShardStats:
    num_samples: int
    num_tokens: int
    num_supervised: int


@dataclass
class ShardSample:
    """One sample read back: ``aux_hidden`` [T, 3, H], ``last_hidden`` [T, H] (de-quantised)."""

    sample_id: str
    input_ids: torch.Tensor  # [T] int64
    loss_mask: torch.Tensor  # [T] uint8
    aux_hidden: torch.Tensor
    last_hidden: torch.Tensor

    @property
    def aux_hidden_flat(self) -> torch.Tensor:
        """[T, 3H]: the three aux layers concatenated per token, the draft's fc input."""
        return self.aux_hidden.reshape(self.aux_hidden.shape[0], -1)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


@dataclass
class ShardSamples:
    """A decoded shard: concatenated per-token tensors plus per-sample offsets and ids.

    Hidden states are held either already in ``out_dtype`` or, for a shard decoded with
    ``keep_stored`` (the trainer's cache), in their stored dtype -- bf16, or fp8 with its per-token
    ``*_scale`` -- and converted to ``out_dtype`` one sample at a time by :meth:`sample`. Both give
    the same values: the conversion is elementwise, so slicing first changes nothing.
    """

    name: str
    sample_ids: list[str]
    offsets: torch.Tensor
    token_ids: torch.Tensor
    loss_mask: torch.Tensor
    aux_hidden: torch.Tensor
    last_hidden: torch.Tensor
    header: dict[str, Any]
    out_dtype: torch.dtype | None = None  # set when hidden states are held as stored
    aux_scale: torch.Tensor | None = None  # fp8 held as stored
    last_scale: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.sample_ids)

    @property
    def nbytes(self) -> int:
        """Bytes held by the shard's tensors (what a cache of shards should count)."""
        held = (self.offsets, self.token_ids, self.loss_mask, self.aux_hidden, self.last_hidden,
                self.aux_scale, self.last_scale)
        return sum(t.numel() * t.element_size() for t in held if t is not None)

    def _hidden(self, x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
        if self.out_dtype is None:
            return x
        if scale is not None:
            return dequantize_fp8(x, scale, self.out_dtype)
        return x.to(self.out_dtype)

    def sample(self, i: int) -> ShardSample:
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        aux_scale = None if self.aux_scale is None else self.aux_scale[a:b]
        last_scale = None if self.last_scale is None else self.last_scale[a:b]
        return ShardSample(self.sample_ids[i], self.token_ids[a:b].long(), self.loss_mask[a:b],
                                  self._hidden(self.aux_hidden[a:b], aux_scale),
                                  self._hidden(self.last_hidden[a:b], last_scale))

    def __iter__(self):
        return (self.sample(i) for i in range(len(self)))


# ----------------------------------------------------------------------------------------------
# fp8


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q float8_e4m3fn with x's shape, scale float32 [x.shape[:-1]]) with x ~= q * scale[..., None]."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1)
    # An all-zero vector gets scale 1 so it stays exactly zero (and nothing divides by zero).
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (xf / scale[..., None]).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (q.float() * scale[..., None]).to(dtype)


# ----------------------------------------------------------------------------------------------
# encode / decode


def encode_shard(samples: list[CapturedHiddenStates], header: DatasetHeader) -> tuple[bytes, ShardStats]:
    """Serialise ``samples`` (in order) into the bytes of one shard file."""
    if not samples:
        raise ExtractError("cannot write an empty shard")
    for s in samples:
        s.check_shapes(header.hidden_size)
    lengths = torch.tensor([s.row.num_tokens for s in samples], dtype=torch.int64)
    offsets = torch.zeros(len(samples) + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(lengths, 0)
    token_ids = torch.tensor([t for s in samples for t in s.row.input_ids], dtype=torch.int32)
    loss_mask = torch.tensor([m for s in samples for m in s.row.loss_mask], dtype=torch.uint8)
    aux = torch.cat([s.aux for s in samples])
    last = torch.cat([s.last for s in samples])
    tensors: dict[str, torch.Tensor] = {"token_ids": token_ids, "loss_mask": loss_mask, "offsets": offsets}
    if header.storage_dtype == "fp8":
        tensors["aux_hidden"], tensors["aux_scale"] = quantize_fp8(aux)
        tensors["last_hidden"], tensors["last_scale"] = quantize_fp8(last)
    elif header.storage_dtype == "bfloat16":
        tensors["aux_hidden"] = aux.to(torch.bfloat16).contiguous()
        tensors["last_hidden"] = last.to(torch.bfloat16).contiguous()
    else:
        raise ExtractError(f"unknown storage dtype {header.storage_dtype!r}")
    metadata = {"format": FORMAT, "sample_ids": json.dumps([s.row.sample_id for s in samples]),
                "header": json.dumps(header.as_dict(), sort_keys=True)}
    stats = ShardStats(len(samples), int(offsets[-1]), int(loss_mask.sum()))
    return st_save(tensors, metadata=metadata), stats


def _metadata(data: bytes) -> dict[str, str]:
    # The safetensors header: 8-byte little-endian length, then JSON with "__metadata__".
    n = int.from_bytes(data[:8], "little")
    return json.loads(data[8:8 + n]).get("__metadata__") or {}


def decode_shard(data: bytes, name: str, out_dtype: torch.dtype = torch.bfloat16, *,
                 keep_stored: bool = False) -> ShardSamples:
    """Parse a shard's bytes; hidden states come back in ``out_dtype`` (fp8 de-quantised).

    ``keep_stored`` holds them as stored and converts each sample when it is served (see
    :class:`ShardSamples`): a cache of such shards costs the stored bytes, not ``out_dtype``'s."""
    try:
        meta = _metadata(data)
        tensors = st_load(data)
    except Exception as exc:  # safetensors raises its own error types
        raise ExtractError(f"hidden-state shard {name} is not a readable safetensors file: {exc}") from exc
    if meta.get("format") != FORMAT:
        raise ExtractError(f"hidden-state shard {name} has format {meta.get('format')!r}, expected {FORMAT!r}")
    aux, last = tensors["aux_hidden"], tensors["last_hidden"]
    stored: dict[str, Any] = {}
    if keep_stored:
        stored["out_dtype"] = out_dtype
        if aux.dtype == torch.float8_e4m3fn:
            stored.update(aux_scale=tensors["aux_scale"], last_scale=tensors["last_scale"])
    elif aux.dtype == torch.float8_e4m3fn:
        aux = dequantize_fp8(aux, tensors["aux_scale"], out_dtype)
        last = dequantize_fp8(last, tensors["last_scale"], out_dtype)
    else:
        aux, last = aux.to(out_dtype), last.to(out_dtype)
    sample_ids = json.loads(meta["sample_ids"])
    offsets = tensors["offsets"]
    if len(sample_ids) + 1 != offsets.shape[0] or int(offsets[-1]) != tensors["token_ids"].shape[0]:
        raise ExtractError(f"hidden-state shard {name}: sample ids, offsets and token count disagree")
    return ShardSamples(name=name, sample_ids=sample_ids, offsets=offsets, token_ids=tensors["token_ids"],
                        loss_mask=tensors["loss_mask"], aux_hidden=aux, last_hidden=last,
                        header=json.loads(meta["header"]), **stored)
