"""Back-pressure in the vLLM backend: the wait runs in the engine child, its line and its timeout come back."""
from __future__ import annotations

import random

import pytest

from peagle.extract import ExtractError, ExtractSettings, run_extract


def make_rows(n: int = 8) -> list[dict]:
    rng = random.Random(3)
    return [{"sample_id": f"conv-{i}", "input_ids": [rng.randrange(480) for _ in range(6)],
             "loss_mask": [0, 0, 1, 1, 1, 1]} for i in range(n)]


@pytest.mark.vllm
def test_vllm_extraction_without_its_trainer_times_out_and_relays_what_it_waits_for(qwen3_target, tmp_path, capfd):
    """The wait runs in the engine child: its waiting line reaches this process's stderr, its timeout
    comes back as the ExtractError it raised there."""
    settings = ExtractSettings(backend="vllm", samples_per_shard=2, engine={"max_num_seqs": 4}, sets_per_worker=2,
                               max_sets_ahead=1, max_sets_ahead_timeout_s=2)
    with pytest.raises(ExtractError, match=r"hs-00001 waited .*\(extract\.max_sets_ahead_timeout_s=2\)"):
        run_extract(make_rows(), qwen3_target, tmp_path / "hs", settings)
    assert "[peagle.extract] shard set hs-00001 waits until a streaming trainer announces itself" in capfd.readouterr().err
    assert (tmp_path / "hs" / "hs-00000" / "_SUCCESS").exists()
