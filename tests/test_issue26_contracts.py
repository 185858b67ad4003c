"""Issue 26, item 1: the typed hand-offs prepared data, draft and report.

Each round-trips through its producer and ``open``/``read``, and refuses a damaged or foreign output
with an error naming it.
"""
from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest
import torch

from peagle.config import DraftSettings
from peagle.data import PrepareError, PreparedData
from peagle.data.output import FORMAT as PREPARED_FORMAT, TOKEN_FREQ, PreparedWriter
from peagle.data.rows import PreparedRow
from peagle.evaluate.report import EVALUATION_KIND, REPORT_FORMAT, Interval, Report, ReportError
from peagle.extract.rows import ExtractRow, prepared_rows
from peagle.model import CheckpointError, Draft, init_draft
from peagle.stage_io import staged


# ---- prepared data ----------------------------------------------------------------------------------


def write_prepared(out, rows: int = 3) -> dict:
    samples = [PreparedRow(f"s{i}", f"s{i}", "src", np.arange(1, 5 + i, dtype=np.int32),
                           np.array([0, 1] * ((4 + i) // 2) + [1] * ((4 + i) % 2), dtype=np.int8))
               for i in range(rows)]
    w = PreparedWriter(out)
    entry = w.write_shard("train", 0, samples)
    freq = w.write_json(TOKEN_FREQ, {"1": 2, "3": 5})
    manifest = {"format": PREPARED_FORMAT, "peagle_version": "test", "created_at": "2024-01-01T00:00:00Z",
                "target": {"path": "/t", "tokenizer_sha256": "ab" * 32, "chat_template_sha256": None,
                           "vocab_size": 64},
                "counts": {"read": rows, "kept": rows, "train": rows, "validation": 0},
                "tokens": {"train": {"total": entry["tokens"], "supervised": 7},
                           "validation": {"total": 0, "supervised": 0}},
                "shards": {"train": [entry], "validation": []}, "token_freq": {**freq, "split": "train"}}
    w.write_manifest(manifest)
    return manifest


def test_prepared_data_opens_with_a_typed_header_and_its_rows(tmp_path):
    manifest = write_prepared(tmp_path / "data")
    data = PreparedData.open(tmp_path / "data")
    h = data.header
    assert h.format == PREPARED_FORMAT and h.target.vocab_size == 64 and h.target.tokenizer_sha256 == "ab" * 32
    assert h.rows("train") == 3 and h.rows("validation") == 0 and h.counts["kept"] == 3
    assert h.shards["train"][0].file == "train-00000.parquet" and h.tokens["train"]["supervised"] == 7
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


# ---- draft ------------------------------------------------------------------------------------------


def test_a_published_draft_opens_with_its_header_and_loads(qwen3_target, tmp_path):
    model = init_draft(str(qwen3_target), DraftSettings(num_layers=1, num_depths=3, draft_vocab_size=128))
    draft = Draft.publish(model, tmp_path / "draft")
    h = draft.header
    spec = model.spec
    assert (h.arch, h.num_layers, h.num_depths, h.mask_token_id) == ("qwen3", 1, 3, spec.mask_token_id)
    assert h.aux_layer_ids == tuple(spec.aux_layer_ids) and h.draft_vocab_size == 128
    assert h.vocab_size == spec.vocab_size and h.hidden_size == spec.hidden_size and h.spec == spec
    assert h.metadata["kind"] == "peagle-draft"
    assert h.manifest_sha256 == hashlib.sha256((tmp_path / "draft" / "_MANIFEST.json").read_bytes()).hexdigest()
    loaded = draft.load()
    want = model.to(torch.bfloat16).float().state_dict()
    assert all(torch.equal(loaded.state_dict()[k], want[k]) for k in want)


def test_a_draft_refuses_a_damaged_or_foreign_output_naming_it(qwen3_target, tmp_path):
    write_prepared(tmp_path / "data")
    with pytest.raises(CheckpointError, match=rf"{tmp_path / 'data'} is published but holds no config\.json: not a draft"):
        Draft.open(tmp_path / "data")
    model = init_draft(str(qwen3_target), DraftSettings(num_layers=1, num_depths=2))
    Draft.publish(model, tmp_path / "draft")
    weights = tmp_path / "draft" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-8])
    with pytest.raises(CheckpointError, match=r"draft .*model\.safetensors has \d+ bytes, manifest says"):
        Draft.open(tmp_path / "draft")
    with pytest.raises(CheckpointError, match=r"is not published \(no _SUCCESS\)"):
        Draft.open(tmp_path / "nothing")
    with staged(tmp_path / "eagle", kind="peagle-draft") as out:  # published, but not a P-EAGLE config
        (out / "config.json").write_text('{"architectures": ["Eagle3Speculator"]}')
        (out / "model.safetensors").write_bytes(b"w")
    with pytest.raises(CheckpointError, match=r"eagle/config\.json: required field 'speculators_model_type'"):
        _ = Draft.open(tmp_path / "eagle").header


# ---- report -----------------------------------------------------------------------------------------


def figures(al: float | None, first: float | None) -> dict:
    return {"acceptance_length": al, "per_position_acceptance": [first, None], "conditional_acceptance": [first, 0.5],
            "confidence": {"acceptance_length": [1.5, 2.5], "per_position_acceptance": [[0.6, 0.8], None]},
            "speedup": 1.7, "tokens_per_s": 40.0, "baseline_tokens_per_s": None}


def report_doc() -> dict:
    return {"format": REPORT_FORMAT, "created_utc": "2024-01-01T00:00:00+00:00", "mode": "offline-api",
            "device": "cpu", "target": {"path": "/t", "fingerprint": "ab"}, "draft": {"path": "/d", "sha256": "cd",
                                                                                   "trained_depths": 2},
            "num_speculative_tokens": [1, 2],
            "summary": {"num_speculative_tokens": 2, "sampling": {"name": "greedy"}, **figures(2.0, 0.7),
                        "lossless": {"compared": 4, "identical": 3, "mismatched_prompts": ["p1"]},
                        "lossless_float32": None,
                        "categories": {"code": figures(2.2, 0.75)},
                        "sets": {"mtbench": {**figures(1.9, 0.65), "categories": ["code"]}}},
            "acceptance_length_vs_k": {"greedy": {"overall": {"1": 1.6, "2": 2.0}, "code": {"1": 1.7, "2": 2.2}}},
            "gate": {"passed": False, "acceptance_length": 2.0, "min_acceptance_length": 2.5,
                     "require_lossless": False, "reasons": ["below"]},
            "runs": [], "offline": None}


def test_a_report_reads_back_typed_and_writes_back_byte_for_byte(tmp_path):
    doc = report_doc()
    text = json.dumps(doc, indent=2) + "\n"
    (tmp_path / "report.json").write_text(text)
    for where in (tmp_path / "report.json", tmp_path):  # the file, or the output directory holding it
        r = Report.read(where)
        assert r.to_json() == text
    s = r.summary
    assert (r.mode, r.device, r.draft_sha256, r.trained_depths, r.num_speculative_tokens) == (
        "offline-api", "cpu", "cd", 2, (1, 2))
    assert s.overall.acceptance_length == 2.0 and s.overall.acceptance_length_interval == Interval(1.5, 2.5)
    assert s.overall.per_position_acceptance == (0.7, None) and s.overall.first_position_interval == Interval(0.6, 0.8)
    assert s.categories["code"].acceptance_length == 2.2 and s.set_categories == {"mtbench": ("code",)}
    assert s.lossless.identical_fraction == 0.75 and s.lossless.differing == ("p1",)
    assert r.acceptance_length_vs_k["greedy"]["overall"] == {1: 1.6, 2: 2.0}
    assert r.gate.passed is False and r.gate.reasons == ["below"]


def test_a_published_evaluate_output_is_read_through_its_manifest(tmp_path):
    with staged(tmp_path / "evaluate", kind=EVALUATION_KIND) as out:
        (out / "report.json").write_text(json.dumps(report_doc(), indent=2) + "\n")
    assert Report.read(tmp_path / "evaluate").summary.overall.acceptance_length == 2.0
    (tmp_path / "evaluate" / "report.json").write_text(json.dumps({**report_doc(), "mode": "endpoint"}, indent=2)
                                                       + "\n")  # changed behind the manifest's back
    with pytest.raises(ReportError, match=r"evaluate/report\.json has \d+ bytes, manifest says"):
        Report.read(tmp_path / "evaluate")
    write_prepared(tmp_path / "data")
    with pytest.raises(ReportError, match=rf"{tmp_path / 'data'} holds a published None, not a 'peagle-evaluation'"):
        Report.read(tmp_path / "data")


def test_a_report_refuses_what_is_not_one_naming_it(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": "something/v1"}')
    with pytest.raises(ReportError, match=rf"{bad}: format 'something/v1' is not 'peagle.evaluate.report/v1'"):
        Report.read(bad)
    bad.write_text("{not json")
    with pytest.raises(ReportError, match=rf"{bad}: not valid JSON"):
        Report.read(bad)
    broken = {**report_doc(), "summary": {"num_speculative_tokens": 2}}
    bad.write_text(json.dumps(broken))
    with pytest.raises(ReportError, match=rf"{bad}: not a complete report \(KeyError"):
        Report.read(bad)
    with pytest.raises(ReportError, match=r"cannot read the report at .*missing"):
        Report.read(tmp_path / "missing")
