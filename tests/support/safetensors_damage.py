"""Damaged safetensors files for tests (issue #29): each corruption of :data:`SAFETENSORS_DAMAGE` leaves a
file safetensors' loader rejects or misreads, with the words the TargetError must say. Shared by
tests/unit/model/test_target.py (a target directory) and the fingerprint tests of a published target
(tests/unit/model/test_target_fingerprint_uri.py, tests/integration/s3/test_target_fingerprint_s3.py)."""
from __future__ import annotations

import json
import struct
from pathlib import Path

WEIGHTS = "model.safetensors"  # the weights file of the tiny targets (tests/support/tiny.py)


def split_safetensors(f: Path) -> tuple[dict, bytes]:
    """(header dict, data bytes) of a safetensors file."""
    raw = f.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def join_safetensors(f: Path, header, data: bytes) -> None:
    h = json.dumps(header).encode()
    f.write_bytes(struct.pack("<Q", len(h)) + h + data)


def _set_length(f, n):
    raw = bytearray(f.read_bytes())
    raw[:8] = struct.pack("<Q", n)
    f.write_bytes(bytes(raw))


def _truncate(f, size):
    with open(f, "r+b") as fh:
        fh.truncate(size)


def _header_len(f):
    return struct.unpack("<Q", f.read_bytes()[:8])[0]


def _first_tensor(header):
    return next(k for k in header if k != "__metadata__")


def _shape_off(f):
    header, data = split_safetensors(f)
    name = _first_tensor(header)
    header[name]["shape"] = [header[name]["shape"][0] + 1, *header[name]["shape"][1:]]
    join_safetensors(f, header, data)


def _offsets_past_end(f):
    header, data = split_safetensors(f)
    name = max((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][1])
    b, e = header[name]["data_offsets"]
    header[name]["data_offsets"] = [b + 10 ** 9, e + 10 ** 9]
    join_safetensors(f, header, data)


def _overlap(f):
    header, data = split_safetensors(f)
    names = sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])
    header[names[1]]["data_offsets"] = list(header[names[0]]["data_offsets"])
    header[names[1]]["dtype"], header[names[1]]["shape"] = header[names[0]]["dtype"], header[names[0]]["shape"]
    join_safetensors(f, header, data)


def _bad_dtype(f):
    header, data = split_safetensors(f)
    header[_first_tensor(header)]["dtype"] = "Q9"
    join_safetensors(f, header, data)


# (corruption, what the message says): each leaves a file safetensors' loader rejects or misreads
SAFETENSORS_DAMAGE = {
    "absurd-header-length": (lambda f: _set_length(f, 2 ** 62), "header length"),
    "negative-header-length": (lambda f: _set_length(f, 2 ** 64 - 1), "header length"),
    "empty": (lambda f: _truncate(f, 0), "8-byte header length"),
    "truncated-header": (lambda f: _truncate(f, 8 + _header_len(f) // 2), "header length"),
    "header-not-json": (lambda f: f.write_bytes(f.read_bytes()[:8] + b"#" + f.read_bytes()[9:]), "not valid JSON"),
    "header-not-object": (lambda f: join_safetensors(f, [1, 2], b""), "JSON object"),
    "truncated-data": (lambda f: _truncate(f, f.stat().st_size - 100), "truncated"),
    "trailing-bytes": (lambda f: f.write_bytes(f.read_bytes() + b"\0" * 64), "trailing"),
    "shape-vs-offsets": (_shape_off, "data_offsets"),
    "offsets-past-end": (_offsets_past_end, "data_offsets"),
    "overlapping-tensors": (_overlap, "data_offsets"),
    "unknown-dtype": (_bad_dtype, "dtype"),
}
