"""AMX tile permission in every vLLM process (issue: SIGILL on Intel CPUs with AMX).

vLLM's CPU attention kernel runs AMX tile instructions on CPUs that have them; Linux kills a process
that has not asked for tile state first. peagle's vLLM general plugin asks in every vLLM process. On a
machine without AMX these tests still show the mechanism: the request is a no-op that reports
"no-amx", and the plugin demonstrably ran inside the spawned worker.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest

from peagle import cpu_features, vllm_plugin

HERE = Path(__file__).parent


def test_plugin_is_registered_for_every_vllm_process():
    plugins = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert plugins.get("peagle") == "peagle.vllm_plugin:register"


def test_amx_request_agrees_with_the_machine():
    status = cpu_features.request_amx()
    if cpu_features.amx_supported():
        assert status in ("granted", "already") and cpu_features.amx_permitted()
    else:
        assert status == "no-amx" and not cpu_features.amx_permitted()
    assert cpu_features.request_amx() in ("no-amx", "already")  # idempotent


def test_cpu_report_runs_with_the_standard_library_alone():
    # CI prints it before any environment is installed.
    out = subprocess.run([sys.executable, "-I", "-S", str(HERE.parent / "src/peagle/cpu_features.py")],
                         capture_output=True, text=True, check=True).stdout
    assert out.startswith("cpu: ") and "amx_tile=" in out and "avx512_bf16=" in out and "amx state: " in out
    flags = cpu_features.cpu_flags()
    assert f"amx_tile={'yes' if 'amx_tile' in flags else 'no'}" in out


def test_plugin_does_nothing_off_the_cpu_platform(monkeypatch):
    from vllm.platforms import current_platform

    requested = []
    monkeypatch.setattr(vllm_plugin, "STATUS", None)
    monkeypatch.setattr(current_platform, "is_cpu", lambda: False)
    monkeypatch.setattr(cpu_features, "request_amx", lambda: requested.append(1) or "granted")
    vllm_plugin.register()
    assert vllm_plugin.STATUS == "not-cpu" and not requested


@pytest.mark.vllm
def test_vllm_runs_the_shape_that_crashed_and_every_worker_asked(tmp_path):
    """hidden 192, one KV head, head_dim 64: vLLM picks its AMX attention kernel on AMX CPUs, and the
    engine died there with SIGILL on its first step before the plugin. It must complete everywhere."""
    from tiny import build_target

    target = build_target(tmp_path / "t192", "qwen3", num_layers=2, hidden=192, num_heads=3, num_kv_heads=1, seed=3)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # vLLM's default: the worker is a spawned process
    proc = subprocess.run([sys.executable, str(HERE / "vllm_amx_probe.py"), str(target), "64"],
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
