"""AMX tile permission in every vLLM process, with a real engine: the shape that crashed with SIGILL on
AMX CPUs (before peagle's vLLM general plugin asked for tile state) completes, and every worker asked."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from support.paths import TESTS

from peagle import cpu_features


@pytest.mark.vllm
def test_vllm_runs_the_shape_that_crashed_and_every_worker_asked(tmp_path):
    """hidden 192, one KV head, head_dim 64: vLLM picks its AMX attention kernel on AMX CPUs, and the
    engine died there with SIGILL on its first step before the plugin. It must complete everywhere."""
    from support.tiny import build_target

    target = build_target(tmp_path / "t192", "qwen3", num_layers=2, hidden=192, num_heads=3, num_kv_heads=1, seed=3)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # vLLM's default: the worker is a spawned process
    proc = subprocess.run([sys.executable, str(TESTS / "support" / "vllm_amx_probe.py"), str(target), "64"],
                          capture_output=True, text=True, timeout=600, env=env)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("PROBE ")), None)
    assert line, f"exit {proc.returncode}:\n" + "\n".join(proc.stderr.splitlines()[-30:])
    probe = json.loads(line[len("PROBE "):])
    assert probe["generated"] == [16, 16, 16]
    [worker] = probe["workers"]
    assert worker["pid"] != probe["front_end"]["pid"]  # the plugin ran inside the spawned worker
    if cpu_features.amx_supported():
        assert probe["attn_isa"] == ["amx"]  # the kernel that crashed is the one that ran
        assert worker["status"] in ("granted", "already") and worker["amx_permitted"]
    else:
        assert worker["status"] == "no-amx" and not worker["amx_permitted"]
        assert probe["front_end"]["status"] == "no-amx"
