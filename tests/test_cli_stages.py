"""The stage commands chain on the command line: prepare -> extract (hf backend) -> a verified dataset."""
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
    out = capsys.readouterr().out
    assert "train:" in out and "[complete]" in out
    total = 0
    for split in ("train", "validation"):
        ds = open_hidden_states(work / "hidden_states" / split, expect_aux_layer_ids=[1, 3, 5],
                                expect_hidden_size=256, expect_fingerprint=fingerprint(qwen3_target))
        total += ds.num_samples
        sample = next(iter(ds))
        assert sample.aux_hidden_flat.shape == (sample.input_ids.shape[0], 3 * 256)
    assert total == 12
    # conflicting aux layer settings are refused, naming both keys
    assert main(["extract", "--target", str(qwen3_target), "--aux-layer-ids", "1", "3", "5",
                 "--set", "draft.aux_layer_ids=[2, 4, 5]", "--set", f"work_dir={work}"]) == 2
    assert "draft.aux_layer_ids" in capsys.readouterr().err
