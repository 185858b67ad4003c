"""Prepared data as a typed hand-off (issue 26): what ``PreparedWriter`` publishes opens through
``PreparedData.open`` with a typed header and its rows, and a damaged shard or a foreign output is refused
with an error naming it."""
from __future__ import annotations

import pytest

from peagle.data import PrepareError, PreparedData
from peagle.data.output import FORMAT as PREPARED_FORMAT, PreparedWriter
from peagle.extract.rows import ExtractRow, prepared_rows
from peagle.stage_io import staged
from support.prepared_data import publish_prepared


def write_prepared(out, rows: int = 3) -> dict:
    """``rows`` rows (s0, s1, ...) published as the train split, token counts {1: 2, 3: 5}; returns the manifest."""
    return publish_prepared(out, [{"sample_id": f"s{i}", "input_ids": list(range(1, 5 + i)),
                                   "loss_mask": [0, 1] * ((4 + i) // 2) + [1] * ((4 + i) % 2)} for i in range(rows)],
                            vocab_size=64, token_freq={"1": 2, "3": 5}, target_path="/t", tokenizer_sha256="ab" * 32,
                            source="src")


def test_prepared_data_opens_with_a_typed_header_and_its_rows(tmp_path):
    manifest = write_prepared(tmp_path / "data")
    data = PreparedData.open(tmp_path / "data")
    h = data.header
    assert h.format == PREPARED_FORMAT and h.target.vocab_size == 64 and h.target.tokenizer_sha256 == "ab" * 32
    assert h.rows("train") == 3 and h.rows("validation") == 0 and h.counts["kept"] == 3
    assert h.shards["train"][0].file == "train-00000.parquet" and h.tokens["train"]["supervised"] == 8
    assert dict(h.metadata) == manifest  # the manifest as published, whole
    assert [r["sample_id"] for r in data.rows("train")] == ["s0", "s1", "s2"]
    assert data.table("validation").num_rows == 0 and data.token_freq() == {1: 2, 3: 5}
    rows = prepared_rows(data, "train")
    assert rows[1] == ExtractRow("s1", (1, 2, 3, 4, 5), (0, 1, 0, 1, 1))


def test_prepared_data_refuses_a_damaged_shard_or_a_foreign_output_naming_it(tmp_path):
    write_prepared(tmp_path / "data")
    shard = tmp_path / "data" / "train-00000.parquet"
    raw = bytearray(shard.read_bytes())
    raw[-20] ^= 1
    shard.write_bytes(bytes(raw))
    with pytest.raises(PrepareError, match=r"train-00000\.parquet: contents do not match"):
        PreparedData.open(tmp_path / "data").table("train")
    with staged(tmp_path / "draft", kind="peagle-draft") as out:
        (out / "config.json").write_text("{}")
    with pytest.raises(PrepareError, match=r"draft/_MANIFEST\.json: format None is not 'peagle.prepared/v1'"):
        PreparedData.open(tmp_path / "draft")
    w = PreparedWriter(tmp_path / "bare")
    w.write_manifest({"format": PREPARED_FORMAT})  # the right format, nothing a reader needs
    with pytest.raises(PrepareError, match=r"bare/_MANIFEST\.json: not a prepared-dataset manifest"):
        PreparedData.open(tmp_path / "bare")
