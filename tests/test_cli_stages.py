"""The stage commands chain on the command line: prepare -> extract (hf backend) -> a verified dataset."""
from __future__ import annotations

import json

from peagle.cli import main
from peagle.extract import open_hidden_states
from peagle.model.target import fingerprint
from seaweed import BUCKET, unique


def test_prepare_then_extract_cli(qwen3_target, tmp_path, capsys):
    src = tmp_path / "chats.jsonl"
    rows = [{"id": str(i), "messages": [{"role": "user", "content": f"Question {i}: what is {i} + {i}?"},
                                         {"role": "assistant", "content": f"The answer is {2 * i}."}]}
            for i in range(12)]
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    work = tmp_path / "work"
    assert main(["prepare", "--target", str(qwen3_target), "--sources", str(src), "--validation-fraction", "0.25",
                 "--set", f"work_dir={work}"]) == 0
    assert main(["extract", "--target", str(qwen3_target), "--backend", "hf", "--samples-per-shard", "4",
                 "--aux-layer-ids", "1", "3", "5", "--set", f"work_dir={work}"]) == 0
    total = 0
    for split in ("train", "validation"):
        ds = open_hidden_states(work / "hidden_states" / split, expect_aux_layer_ids=[1, 3, 5],
                                expect_hidden_size=256, expect_fingerprint=fingerprint(qwen3_target))
        total += ds.num_samples
        sample = next(iter(ds))
        assert sample.aux_hidden_flat.shape == (sample.input_ids.shape[0], 3 * 256)
    assert total == 12
    # train on the extracted shards (through the same CLI), then the final draft is vLLM-format
    assert main(["train", "--target", str(qwen3_target), "--data", str(work / "hidden_states" / "train"),
                 "--output", str(work / "store"), "--row-tokens", "128", "--global-batch-rows", "2",
                 "--max-steps", "3", "--val-fraction", "0", "--num-depths", "2", "--draft-vocab-size", "128",
                 "--aux-layer-ids", "1", "3", "5", "--set", f"work_dir={work}"]) == 0
    from peagle.model import read_spec
    from peagle.stage_io import fetched_input

    spec = read_spec(fetched_input(str(work / "store" / "final")))  # the published servable draft
    assert spec.aux_layer_ids == [1, 3, 5] and spec.num_depths == 2 and spec.draft_vocab_size == 128
    # conflicting aux layer settings are refused, naming both keys
    assert main(["extract", "--target", str(qwen3_target), "--aux-layer-ids", "1", "3", "5",
                 "--set", "draft.aux_layer_ids=[2, 4, 5]", "--set", f"work_dir={work}"]) == 2
    assert "draft.aux_layer_ids" in capsys.readouterr().err


def test_prepare_and_extract_through_s3(qwen3_target, tmp_path, monkeypatch, seaweed_server, capsys):
    """Stage outputs land in a real S3-compatible store (SeaweedFS) and the next stage reads them there."""
    from peagle.storage import is_complete, open_store

    for k, v in seaweed_server.env().items():
        monkeypatch.setenv(k, v)
    src = tmp_path / "chats.jsonl"
    src.write_text("".join(json.dumps({"id": str(i), "messages": [
        {"role": "user", "content": f"Name {i} colours."}, {"role": "assistant", "content": "Red and blue."}]}) + "\n"
        for i in range(6)))
    root = f"s3://{BUCKET}/{unique('run')}"
    assert main(["prepare", "--target", str(qwen3_target), "--sources", str(src), "--validation-fraction", "0",
                 "--out", f"{root}/data", "--no-dedup"]) == 0
    assert is_complete(open_store(f"{root}/data"), "")
    assert main(["extract", "--target", str(qwen3_target), "--backend", "hf", "--data", f"{root}/data",
                 "--out", f"{root}/hs", "--splits", "train", "--samples-per-shard", "2"]) == 0
    ds = open_hidden_states(f"{root}/hs/train", expect_hidden_size=256, expect_fingerprint=fingerprint(qwen3_target))
    assert ds.num_samples == 6 and len(ds.shard_names) == 3
    assert sum(s.input_ids.shape[0] for s in ds) == ds.num_tokens
    # rerun: every shard set is already published in the bucket, nothing is recomputed or republished
    hs = open_store(f"{root}/hs")

    def published() -> dict[str, bytes]:  # every object with its bytes (manifests carry their creation time)
        return {key: hs.get_bytes(key) for key in hs.list()}

    before = published()
    assert main(["extract", "--target", str(qwen3_target), "--backend", "hf", "--data", f"{root}/data",
                 "--out", f"{root}/hs", "--splits", "train", "--samples-per-shard", "2"]) == 0
    assert published() == before


def test_regenerate_refuses_an_out_that_is_one_of_its_sources(tmp_path, capsys):
    src = tmp_path / "convs.jsonl"
    src.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    before = src.read_bytes()
    assert main(["regenerate", "--set", f"regenerate.sources=[{src}]", "--set", "regenerate.endpoint=http://127.0.0.1:9",
                 "--out", str(src)]) == 2
    assert "refusing" in capsys.readouterr().err and src.read_bytes() == before
