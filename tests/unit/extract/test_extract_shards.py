"""Sharded output of the extraction stage (hf backend on the tiny Qwen3 target): writer/reader round
trip, checksums, rerun skipping, fan-out, fp8 storage, and refusing mismatched datasets."""
from __future__ import annotations

import hashlib
import json
import shutil

import pytest
import torch

from peagle.extract import (DatasetMismatchError, ExtractError, ExtractSettings, HiddenStatesDataset,
                            ShardChecksumError, resolve_layer_ids, run_extract)
from peagle.cli import main
from peagle.extract.hf_backend import HfHiddenStatesExtractor
from peagle.extract.rows import ExtractRow
from peagle.model.target import fingerprint
from support.extract_shards import HF, check_a_shard_set_killed_midway_is_redone, make_rows
from support.prepared_data import write_prepared

@pytest.fixture(scope="module")
def base(qwen3_target, tmp_path_factory):
    """One bf16 extraction (8 rows, 3 shards) that the tests copy and damage."""
    out = tmp_path_factory.mktemp("extract") / "bf16"
    res = run_extract(make_rows(), qwen3_target, out, ExtractSettings(**HF))
    assert res.shards_written == ["hs-00000-00000.safetensors", "hs-00000-00001.safetensors",
                                  "hs-00000-00002.safetensors"]
    assert res.manifest is not None
    return out


def _copy(base, tmp_path):
    dst = tmp_path / "copy"
    shutil.copytree(base, dst)
    return dst


def _flip_byte(path, offset_from_end: int = 100) -> None:
    data = bytearray(path.read_bytes())
    data[-offset_from_end] ^= 0x01
    path.write_bytes(bytes(data))


def test_round_trip(base, qwen3_target):
    rows = make_rows()
    manifest = json.loads((base / "_MANIFEST.json").read_text())["metadata"]  # the dataset's publication
    assert manifest["layer_ids"] == [2, 4, 5, 8] and manifest["aux_layer_ids"] == [2, 4, 5]
    assert manifest["last_layer_id"] == 8 and manifest["hidden_size"] == 256
    assert manifest["target_fingerprint"] == fingerprint(qwen3_target)
    assert manifest["storage_dtype"] == "bfloat16" and manifest["compute_dtype"] == "bfloat16"
    assert manifest["totals"]["num_samples"] == 8
    assert manifest["totals"]["num_tokens"] == sum(len(r["input_ids"]) for r in rows)
    for entry in manifest["shards"]:
        assert entry["sha256"] == hashlib.sha256((base / "hs-00000" / entry["name"]).read_bytes()).hexdigest()

    ds = HiddenStatesDataset(base, expect_layer_ids=[2, 4, 5, 8], expect_hidden_size=256,
                             expect_fingerprint=fingerprint(qwen3_target))
    got = list(ds)
    assert [s.sample_id for s in got] == [r["sample_id"] for r in rows]  # one shard set: input order
    direct = HfHiddenStatesExtractor(qwen3_target, resolve_layer_ids(None, 8), "bfloat16", batch_size=4,
                                     device="cpu")
    for s, r in zip(got, rows):
        assert s.input_ids.tolist() == r["input_ids"] and s.loss_mask.tolist() == r["loss_mask"]
        assert s.aux_hidden.shape == (len(r["input_ids"]), 3, 256) and s.aux_hidden_flat.shape[1] == 768
        assert s.aux_hidden.dtype == torch.bfloat16
    ref = direct.extract([ExtractRow(r["sample_id"], tuple(r["input_ids"]), tuple(r["loss_mask"])) for r in rows[:3]])
    for s, e in zip(got[:3], ref):  # same batching as the first shard: bit-identical
        assert torch.equal(s.aux_hidden, e.aux) and torch.equal(s.last_hidden, e.last)

    # no prefetch reads the same samples
    assert [s.sample_id for s in ds.iter_samples(prefetch=0)] == [s.sample_id for s in got]


def test_next_shard_is_read_in_the_background(base):
    import threading
    import time

    ds = HiddenStatesDataset(base)
    reads = []
    plain_read = ds.read_shard

    def recording_read(name):
        reads.append((name, threading.current_thread().name))
        return plain_read(name)

    ds.read_shard = recording_read
    it = ds.iter_shards(prefetch=1)
    first = next(it)
    time.sleep(0.5)  # the consumer is busy with the first shard ...
    assert first.name == ds.shard_names[0]
    assert [n for n, _ in reads][:2] == ds.shard_names[:2]  # ... while the second is already being read
    assert all(t.startswith("peagle-hs-prefetch") for _, t in reads)
    assert [s.name for s in it] == ds.shard_names[1:]
    it.close()


def test_flipped_byte_is_detected_naming_the_shard(base, tmp_path):
    d = _copy(base, tmp_path)
    _flip_byte(d / "hs-00000" / "hs-00000-00001.safetensors")
    ds = HiddenStatesDataset(d)
    it = ds.iter_samples(prefetch=1)
    assert [next(it).sample_id for _ in range(3)] == ["conv-0", "conv-1", "conv-2"]  # shard 0 is intact
    with pytest.raises(ShardChecksumError, match=r"hs-00000-00001\.safetensors is corrupt") as err:
        next(it)
    assert err.value.shard == "hs-00000-00001.safetensors"
    assert err.value.uri == (d / "hs-00000" / "hs-00000-00001.safetensors").as_uri() and err.value.uri in str(err.value)


def test_rerun_skips_published_shards_and_repairs_broken_ones(base, qwen3_target, tmp_path):
    d = _copy(base, tmp_path)
    shards = sorted(p.name for p in d.glob("hs-00000/*.safetensors"))
    d = d / "hs-00000"  # the shard set's prefix
    mtimes = {n: (d / n).stat().st_mtime_ns for n in shards}
    success = (d.parent / "_SUCCESS").stat().st_mtime_ns
    res = run_extract(make_rows(), qwen3_target, d.parent, ExtractSettings(**HF))
    assert res.shards_written == [] and res.shards_skipped == shards and res.manifest is not None
    assert all((d / n).stat().st_mtime_ns == mtimes[n] for n in shards)
    assert (d.parent / "_SUCCESS").stat().st_mtime_ns == success  # nothing changed: not republished

    _flip_byte(d / shards[1])
    res = run_extract(make_rows(), qwen3_target, d.parent, ExtractSettings(**HF))
    assert res.shards_written == [shards[1]] and res.shards_skipped == [shards[0], shards[2]]
    assert (d / shards[0]).stat().st_mtime_ns == mtimes[shards[0]]
    assert len(list(HiddenStatesDataset(d.parent))) == 8  # repaired: every checksum verifies again


def test_changed_settings_or_samples_rewrite_the_shards(base, qwen3_target, tmp_path):
    d = _copy(base, tmp_path)
    res = run_extract(make_rows(), qwen3_target, d, ExtractSettings(**HF, aux_layer_ids=[1, 3, 6]))
    assert len(res.shards_written) == 3  # another header: nothing is reused
    assert HiddenStatesDataset(d, expect_layer_ids=[1, 3, 6, 8]).num_samples == 8
    rows = make_rows()
    rows[4]["sample_id"] = "conv-renamed"
    res = run_extract(rows, qwen3_target, d, ExtractSettings(**HF, aux_layer_ids=[1, 3, 6]))
    assert res.shards_written == ["hs-00000-00001.safetensors"]  # only the shard holding row 4


def test_fan_out_round_robin_and_manifest_by_the_last_worker(base, qwen3_target, tmp_path):
    out = tmp_path / "fan"
    rows = make_rows()
    r1 = run_extract(rows, qwen3_target, out, ExtractSettings(**HF), shard_index=1, num_shards=2)
    assert r1.num_samples == 4 and r1.manifest is None and not (out / "_SUCCESS").exists()
    assert (out / "hs-00001" / "_SUCCESS").is_file()  # its shard set is published
    with pytest.raises(ExtractError, match=rf"{out} is not a complete hidden-state dataset.*no _SUCCESS"):
        HiddenStatesDataset(out)
    r0 = run_extract(rows, qwen3_target, out, ExtractSettings(**HF), shard_index=0, num_shards=2)
    assert r0.manifest is not None and r0.manifest["num_shard_sets"] == 2
    ds = HiddenStatesDataset(out)
    assert ds.shard_names == ["hs-00000-00000.safetensors", "hs-00000-00001.safetensors",
                              "hs-00001-00000.safetensors", "hs-00001-00001.safetensors"]
    by_id = {s.sample_id: s for s in ds}
    assert [s.sample_id for s in ds.read_shard("hs-00001-00000.safetensors")] == ["conv-1", "conv-3", "conv-5"]
    ref = {s.sample_id: s for s in HiddenStatesDataset(base)}
    assert by_id.keys() == ref.keys()
    for k, s in by_id.items():  # other batch compositions: the same values up to bf16 noise
        a, b = s.last_hidden.float(), ref[k].last_hidden.float()
        assert ((a - b).norm() / b.norm()).item() < 0.02


def test_fp8_round_trip_error_and_size(base, qwen3_target, tmp_path):
    out = tmp_path / "fp8"
    run_extract(make_rows(), qwen3_target, out, ExtractSettings(**HF, storage_dtype="fp8"))
    fp8 = HiddenStatesDataset(out, out_dtype=torch.float32)
    ref = HiddenStatesDataset(base, out_dtype=torch.float32)
    assert fp8.manifest["storage_dtype"] == "fp8"
    worst_rel = 0.0
    for a, b in zip(fp8, ref):
        assert a.sample_id == b.sample_id and torch.equal(a.input_ids, b.input_ids)
        for q, x in ((a.aux_hidden, b.aux_hidden), (a.last_hidden, b.last_hidden)):
            scale = x.abs().amax(dim=-1, keepdim=True) / 448
            bound = x.abs() * 2**-4 + scale * 2**-10 + 1e-6  # 3 mantissa bits; subnormal step
            assert ((q - x).abs() <= bound).all()
            worst_rel = max(worst_rel, ((q - x).norm() / x.norm()).item())
    assert worst_rel < 0.04

    bytes_fp8 = fp8.manifest["totals"]["bytes"]
    bytes_bf16 = ref.manifest["totals"]["bytes"]
    n, h = ref.num_tokens, 256
    ratio = bytes_fp8 / bytes_bf16
    per_token_fp8, per_token_bf16 = bytes_fp8 / n, bytes_bf16 / n
    print(f"\nbytes/token: fp8 {per_token_fp8:.0f}, bf16 {per_token_bf16:.0f}, ratio {ratio:.3f}")
    # payload 4H bytes + 4 float32 scales vs 8H bytes; ids and mask (5 bytes) are the same in both
    expected = (4 * h + 16 + 5) / (8 * h + 5)
    assert ratio == pytest.approx(expected, abs=0.01) and ratio < 0.52


def test_mismatched_datasets_are_refused(base, llama_target):
    with pytest.raises(DatasetMismatchError, match=r"layer ids \[2, 4, 5, 8\].*\[2, 4, 6, 8\]"):
        HiddenStatesDataset(base, expect_layer_ids=[2, 4, 6, 8])
    with pytest.raises(DatasetMismatchError, match="aux layer ids"):
        HiddenStatesDataset(base, expect_aux_layer_ids=[1, 4, 5])
    with pytest.raises(DatasetMismatchError, match="target fingerprint"):
        HiddenStatesDataset(base, expect_fingerprint=fingerprint(llama_target))
    with pytest.raises(DatasetMismatchError, match="hidden size 256.*512"):
        HiddenStatesDataset(base, expect_hidden_size=512)
    assert HiddenStatesDataset(base, expect_aux_layer_ids=[2, 4, 5]).num_samples == 8


def test_bad_input_is_refused_naming_the_sample(qwen3_target, tmp_path):
    rows = make_rows(4)
    rows[3]["sample_id"] = rows[1]["sample_id"]
    with pytest.raises(ExtractError, match="'conv-1' occurs more than once"):
        run_extract(rows, qwen3_target, tmp_path / "dup", ExtractSettings(**HF))
    with pytest.raises(ExtractError, match="no input rows"):
        run_extract([], qwen3_target, tmp_path / "empty", ExtractSettings(**HF))
    with pytest.raises(ValueError, match="shard_index"):
        run_extract(make_rows(2), qwen3_target, tmp_path / "x", ExtractSettings(**HF), shard_index=2, num_shards=2)


def test_trainer_dataset_reads_each_shard_once_when_it_fits(base, monkeypatch):
    """The trainer's view (peagle.train.data.ExtractedDataset) keeps decoded shards up to a byte budget:
    a dataset that fits is read (and sha256-verified) once, in any access order; a small budget
    still keeps two shards and re-reads the rest."""
    from peagle.train.data import ExtractedDataset

    reads: list[str] = []
    original = HiddenStatesDataset.read_shard
    monkeypatch.setattr(HiddenStatesDataset, "read_shard", lambda self, name: reads.append(name) or original(self, name))
    order = [7, 0, 5, 1, 6, 2, 4, 3] * 2
    ds = ExtractedDataset(str(base))
    samples = {i: ds[i] for i in order}
    assert sorted(reads) == sorted(set(reads)) and len(reads) == 3  # the opening pass only
    reads.clear()
    small = ExtractedDataset(str(base), cache_bytes=1)
    again = {i: small[i] for i in order}
    assert len(small._cache) == 2 and len(reads) > 3
    for i in order:  # same samples either way
        assert again[i]["sample_id"] == samples[i]["sample_id"]
        assert torch.equal(again[i]["aux_hidden"], samples[i]["aux_hidden"])


@pytest.mark.parametrize("storage_dtype", ["bfloat16", "fp8"])
def test_trainer_cache_holds_stored_bytes_and_serves_the_same_samples(base, qwen3_target, tmp_path, storage_dtype):
    """The trainer's cache keeps hidden states as stored (bf16, or fp8 + scales) and widens one sample
    at a time: the samples it serves are bitwise those of a float32 cache, at a half (bf16) or about a
    quarter (fp8) of its bytes."""
    from peagle.train.data import ExtractedDataset

    root = base
    if storage_dtype == "fp8":
        root = tmp_path / "fp8"
        run_extract(make_rows(), qwen3_target, root, ExtractSettings(**HF, storage_dtype="fp8"))
    stored, wide = ExtractedDataset(str(root)), ExtractedDataset(str(root), cache_stored=False)
    assert len(stored) == len(wide) == 8
    for i in range(len(stored)):
        a, b = stored[i], wide[i]
        assert a["sample_id"] == b["sample_id"]
        for key in ("input_ids", "loss_mask", "aux_hidden", "last_hidden"):
            assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key
        assert a["aux_hidden"].dtype == torch.float32
    ratio = stored._cached_bytes / wide._cached_bytes
    h = 256  # tiny Qwen3 hidden size; 4 hidden vectors per token (3 aux + last)
    hidden_ratio = {"bfloat16": 2 / 4, "fp8": (4 * h + 4 * 4) / (4 * h * 4)}[storage_dtype]
    assert ratio == pytest.approx(hidden_ratio, abs=0.02)


def test_a_shard_set_killed_midway_is_redone_and_complete_ones_are_skipped(qwen3_target, tmp_path, monkeypatch):
    """Two shard sets: set 0 publishes; set 1's worker dies after writing its first shard (no _SUCCESS).
    On rerun set 0 is skipped untouched, set 1 is redone whole, and the dataset gets published.
    (On a real S3 store: tests/integration/s3/test_extract_shards_s3.py.)"""
    check_a_shard_set_killed_midway_is_redone(qwen3_target, str(tmp_path / "hs"), monkeypatch)


def test_an_old_layout_extraction_is_refused_naming_it(tmp_path):
    old = tmp_path / "old"
    old.mkdir()
    (old / "manifest.json").write_text("{}")  # manifest.json + per-shard records: before _MANIFEST.json
    with pytest.raises(ExtractError, match=rf"{old} holds a hidden-state dataset in the old layout"):
        HiddenStatesDataset(old)


def test_the_dataset_publication_is_the_same_whichever_worker_writes_it(base, qwen3_target, tmp_path):
    """Workers finishing together may both publish the dataset: their manifests are the same bytes
    (dated by the newest shard set), so whatever the interleaving, _SUCCESS matches _MANIFEST.json."""
    from peagle.storage import LocalStore, is_complete, unpublish

    d = _copy(base, tmp_path)
    first = (d / "_MANIFEST.json").read_bytes()
    unpublish(LocalStore(d), "")
    res = run_extract(make_rows(), qwen3_target, d, ExtractSettings(**HF))  # finds every set published
    assert res.shards_written == [] and is_complete(LocalStore(d), "")
    assert (d / "_MANIFEST.json").read_bytes() == first


def test_a_missing_shard_of_a_published_set_is_named_not_unpublished(tmp_path):
    from pathlib import Path

    from peagle.extract import dataset_manifest
    from peagle.extract.errors import ExtractError
    from peagle.extract.shard_format import FORMAT
    from peagle.storage import DamagedPrefixError, LocalStore, open_published, publish

    root = tmp_path / "hs"
    store = LocalStore(root)
    shard = "hs-00000/hs-00000-00001.safetensors"
    publish(store, "", {"hs-00000/hs-00000-00000.safetensors": b"a", shard: b"b"}, {"format": FORMAT})
    assert dataset_manifest(root) == {"format": FORMAT}
    (root / shard).unlink()
    with pytest.raises(DamagedPrefixError, match=f"published but damaged: .*{shard} is named in the manifest but"):
        open_published(store, "")
    with pytest.raises(ExtractError) as e:
        dataset_manifest(root)  # was None: "extraction did not complete"
    msg = str(e.value)
    assert shard in msg and "missing" in msg and "not published" not in msg and "unfinished" not in msg

    from peagle.pipeline.layout import RunLayout
    from peagle.pipeline.training import check_extraction

    layout = RunLayout(str(tmp_path / "run"))
    hs = Path(layout.hidden_states("train"))
    publish(LocalStore(hs), "", {"hs-00000/x.safetensors": b"x"}, {"format": FORMAT})
    (hs / "hs-00000" / "x.safetensors").unlink()
    with pytest.raises(ExtractError, match=r"hs-00000/x\.safetensors is named in the manifest but missing"):
        check_extraction(layout)


# -- fan-out arguments: a shard outside the fan-out is refused before any work ---------------------------


@pytest.mark.parametrize("index, count, named", [(5, 2, "--shard-index 5: must be in [0, 1] (--num-shards 2)"),
                                                 (-1, 2, "--shard-index -1: must be in [0, 1] (--num-shards 2)"),
                                                 (0, 0, "--num-shards 0: must be at least 1 (the number of "
                                                        "extraction workers)")])
def test_peagle_extract_refuses_a_shard_outside_the_fan_out(qwen3_target, tmp_path, capsys, index, count, named):
    data = write_prepared(tmp_path / "data", make_rows())
    code = main(["extract", "--target", str(qwen3_target), "--backend", "hf", "--data", str(data), "--splits", "train",
                 "--out", str(tmp_path / "hs"), "--shard-index", str(index), "--num-shards", str(count)])
    assert code == 2
    assert capsys.readouterr().err == f"peagle: error: {named}\n"
    assert not (tmp_path / "hs").exists()


def test_run_extract_refuses_a_shard_outside_the_fan_out(qwen3_target, tmp_path):
    with pytest.raises(ExtractError, match=r"^shard_index 5: must be in \[0, 1\] \(num_shards 2\)$"):
        run_extract(make_rows(), qwen3_target, tmp_path / "hs", ExtractSettings(**HF), shard_index=5, num_shards=2)
    with pytest.raises(ExtractError, match=r"^num_shards 0: must be at least 1"):
        run_extract(make_rows(), qwen3_target, tmp_path / "hs", ExtractSettings(**HF), shard_index=0, num_shards=0)
    assert not (tmp_path / "hs").exists()
