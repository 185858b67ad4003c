"""AMX tile permission in every vLLM process (issue: SIGILL on Intel CPUs with AMX).

vLLM's CPU attention kernel runs AMX tile instructions on CPUs that have them; Linux kills a process
that has not asked for tile state first. peagle's vLLM general plugin asks in every vLLM process. On a
machine without AMX these tests still show the mechanism: the request is a no-op that reports
"no-amx", and the plugin demonstrably ran inside the spawned worker.
"""
from __future__ import annotations

import subprocess
import sys
from importlib.metadata import entry_points

from support.paths import REPO

from peagle import cpu_features, vllm_plugin


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
    out = subprocess.run([sys.executable, "-I", "-S", str(REPO / "src/peagle/cpu_features.py")],
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
