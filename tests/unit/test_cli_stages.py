"""The stage commands chain on the command line: prepare -> extract (hf backend) -> a verified dataset
(through a real S3 store: tests/integration/s3/test_cli_stages_s3.py)."""
from __future__ import annotations

import json

from peagle.cli import main
from peagle.extract import open_hidden_states
from peagle.model.target import fingerprint


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


def test_regenerate_refuses_an_out_that_is_one_of_its_sources(tmp_path, capsys):
    src = tmp_path / "convs.jsonl"
    src.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    before = src.read_bytes()
    assert main(["regenerate", "--set", f"regenerate.sources=[{src}]", "--set", "regenerate.endpoint=http://127.0.0.1:9",
                 "--out", str(src)]) == 2
    assert "refusing" in capsys.readouterr().err and src.read_bytes() == before
