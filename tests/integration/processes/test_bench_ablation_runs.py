"""bench/bench_ablation.py --dry-run on CPU as a real process, so the ablation runner cannot rot between real
runs: it builds a tiny hidden-state dataset from ShareGPT rows (transformers backend), trains the variants
of the embedded recipe for 2 steps in their own processes, validates their evaluation configurations and
loads the held-out prompts; vLLM is not started.
"""
from __future__ import annotations

import subprocess
import sys

import yaml

from support.bench_scripts import BENCH

SCRIPT = BENCH / "bench_ablation.py"


def _run(*args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout)


def test_dry_run_trains_each_variant_and_prints_one_table(qwen3_target, tmp_path):
    r = _run("--dry-run", "--target", str(qwen3_target), "--work", str(tmp_path / "w"),
             "--variants", "baseline,init-top-layer", "--variant", "wd0:train.weight_decay=0")
    assert r.returncode == 0, r.stdout + r.stderr[-4000:]
    lines = r.stdout.strip().splitlines()
    assert lines[0].startswith("machine: ")  # the banner, then the table
    head = next(i for i, line in enumerate(lines) if line.startswith("variant"))
    assert lines[head].split()[:4] == ["variant", "overrides", "train", "s"]
    assert "first-position acceptance" in lines[head]
    body = {line.split()[0]: line for line in lines[head + 2:-1]}
    assert set(body) == {"baseline", "init-top-layer", "wd0"}
    assert "draft.init_from_target_layer=True" in body["init-top-layer"] and "train.weight_decay=0" in body["wd0"]
    for line in body.values():
        assert line.split()[3] == "2" and "dry run (48 prompts)" in line  # 2 steps trained, 48 held-out prompts
    for name in body:
        assert (tmp_path / "w" / name / "store" / "final" / "model.safetensors").is_file()
        ev = yaml.safe_load((tmp_path / "w" / name / "evaluate.yaml").read_text())["evaluate"]
        assert ev["prompt_sets"] == ["sharegpt-heldout@48"] and ev["num_speculative_tokens"] == [4]
    cfg = yaml.safe_load((tmp_path / "w" / "init-top-layer" / "train.yaml").read_text())
    assert cfg["draft"]["init_from_target_layer"] is True and cfg["train"]["lr"] == 3e-3  # the embedded recipe
