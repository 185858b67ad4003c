"""The gate (peagle.gate.run) on a real vLLM engine: the whole gate on the tiny target with the same
untrained draft as serving and candidate: nothing can differ, so the traffic gain fails with a difference
of exactly 0 while the float32 check and loading pass. (The gate's statistics, verdict and reports without
vLLM: tests/unit/traffic/test_traffic_gate.py.)"""
from __future__ import annotations

import pytest

from peagle.evaluate.settings import EvaluateEngineSettings
from peagle.gate.run import run_gate
from peagle.gate.report import GateResult, summary_lines
from peagle.gate.settings import GateSettings
from support.traffic_prompts import prompt_file

# the engines: a short context, a small batch, in-process (on CPU an engine starts in seconds)
VLLM_ENGINE = EvaluateEngineSettings(max_model_len=512, max_num_seqs=8, cpu_kv_cache_gib=1, in_process=True,
                                     timeout_s=900)


@pytest.mark.vllm
def test_identical_drafts_gain_nothing_but_load_and_stay_lossless(qwen3_target, ladder_init_draft, tmp_path):
    traffic = prompt_file(tmp_path / "heldout.jsonl", 4)
    general = prompt_file(tmp_path / "general.jsonl", 3, "general")
    result = run_gate(target=str(qwen3_target), serving_draft=str(ladder_init_draft),
                      candidate_draft=str(ladder_init_draft), traffic_prompts=traffic, general=str(general),
                      settings=GateSettings(min_traffic_prompts=4, max_tokens=16, lossless_prompts=2, neighbour="code@2",
                                            lossless_max_tokens=8, resamples=200, speed_concurrency=2,
                                            speed_requests_per_load=3, speed_max_tokens=8),
                      engine=VLLM_ENGINE, out=str(tmp_path / "gate"))
    assert (tmp_path / "gate" / "gate.json").is_file() and GateResult.read(tmp_path / "gate") == result
    checks = {c.name: c for c in result.checks}
    assert checks["loads"].passed and checks["lossless_float32"].passed and checks["enough_traffic"].passed
    t = result.sets["traffic"]
    assert t.prompts == 4 and t.acceptance_length_difference.value == 0.0
    n = result.sets["neighbour"]  # the same domain from another source, measured on the same engines
    assert n.prompts == 2 and n.acceptance_length_difference.value == 0.0 and checks["neighbour_loss"].passed
    assert result.sources["neighbour"] == "code@2"
    assert t.acceptance_length_difference.interval == (0.0, 0.0)
    assert not checks["traffic_gain"].passed and not result.passed
    assert t.serving.steps > 0 and t.serving == t.candidate  # vLLM returned per-request histograms
    assert result.num_speculative_tokens == 2 and result.lossless_float32["compared"] == 2
    # speed at the deployed load: the same draft twice, and the target alone, each an engine of its own
    speed = checks["speed"]
    assert speed.value is not None and speed.value > 0 and speed.threshold == 0.97
    assert "at 2 requests in flight the candidate runs" in speed.detail and "the target alone" in speed.detail
    assert "2 round(s) in alternating order" in speed.detail  # gate.speed_rounds: three engines twice
    assert [c.name for c in result.checks][-2:] == ["speed", "loads"]
    print("\n".join(summary_lines(result)), f"\ntiming: {result.timing}")
