"""Prepared data as a typed hand-off (issue 26): what ``PreparedWriter`` publishes opens through
``PreparedData.open`` with a typed header and its rows (:class:`PreparedRow`, the one reader of prepared rows),
and a damaged shard, a damaged row or a foreign output is refused with an error naming it. The writer's rows
API (issue 38): shards of ``shard_rows``, the token totals and frequencies it keeps, nothing left on failure."""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from peagle.data import PrepareError, PreparedData, output
from peagle.data.output import FORMAT as PREPARED_FORMAT, SCHEMA, TOKEN_FREQ, PreparedWriter
from peagle.data.rows import PreparedRow
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
    assert [r.sample_id for r in data.rows("train")] == ["s0", "s1", "s2"]
    assert data.table("validation").num_rows == 0 and data.token_freq() == {1: 2, 3: 5}
    assert data.rows("validation") == []
    row = data.rows("train")[1]
    assert isinstance(row, PreparedRow) and (row.sample_id, row.split_key, row.source) == ("s1", "s1", "src")
    assert row.input_ids.tolist() == [1, 2, 3, 4, 5] and row.loss_mask.tolist() == [0, 1, 0, 1, 1]
    assert (row.input_ids.dtype, row.loss_mask.dtype) == (np.int32, np.int8) and row.num_supervised == 3


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


def test_a_row_whose_ids_and_mask_differ_in_length_is_refused_naming_the_shard_and_row(tmp_path, monkeypatch):
    bad = pa.table({"sample_id": ["s0", "s1"], "source": ["src", "src"], "input_ids": [[1, 2], [3, 4, 5]],
                    "loss_mask": [[0, 1], [1, 1]], "num_tokens": [2, 3], "num_supervised": [1, 2]}, schema=SCHEMA)
    monkeypatch.setattr(output, "samples_to_table", lambda samples: bad)  # a shard no writer of ours makes
    write_prepared(tmp_path / "data", rows=2)
    with pytest.raises(PrepareError, match=r"data/train-00000\.parquet: row 1 \(sample 's1'\) has 3 input_ids but 2 "
                                           r"loss_mask entries"):
        PreparedData.open(tmp_path / "data").rows("train")


def _row(sid: str, ids: list[int], mask: list[int]) -> PreparedRow:
    return PreparedRow(sid, sid, "src", np.array(ids, dtype=np.int32), np.array(mask, dtype=np.int8))


def test_the_writer_cuts_shards_and_counts_what_the_manifest_lists(tmp_path):
    train = [_row(f"t{i}", [i, 7, 9], [0, 1, 1]) for i in range(5)]
    with PreparedWriter(tmp_path / "data", shard_rows=2) as w:
        for row in train:
            w.add("train", row)
        w.add("validation", _row("v0", [5, 5], [1, 1]))  # validation tokens are not counted in token_freq
        manifest = w.publish({"target": {"path": "/t", "tokenizer_sha256": "ab" * 32, "vocab_size": 16},
                              "counts": {"kept": 6, "train": 5, "validation": 1}, "tokens": "replaced"}, extra=1)
    assert [e["rows"] for e in manifest["shards"]["train"]] == [2, 2, 1]
    assert [e["file"] for e in manifest["shards"]["validation"]] == ["validation-00000.parquet"]
    assert manifest["tokens"] == {"train": {"total": 15, "supervised": 10}, "validation": {"total": 2, "supervised": 2}}
    assert manifest["token_freq"]["distinct_ids"] == 2 and manifest["token_freq"]["total"] == 10
    assert manifest["columns"] == SCHEMA.names and manifest["extra"] == 1 and manifest["format"] == PREPARED_FORMAT
    data = PreparedData.open(tmp_path / "data")
    assert dict(data.header.metadata) == manifest and data.token_freq() == {7: 5, 9: 5}
    assert [r.sample_id for r in data.rows("train")] == [r.sample_id for r in train]


def test_a_failure_inside_the_writer_leaves_nothing_behind(tmp_path):
    with pytest.raises(RuntimeError, match="stopped"):
        with PreparedWriter(tmp_path / "data", shard_rows=1) as w:
            w.add("train", _row("t0", [1, 2], [0, 1]))
            w.write_json(TOKEN_FREQ, {})
            raise RuntimeError("stopped")
    assert sorted(p.name for p in (tmp_path / "data").iterdir()) == []
