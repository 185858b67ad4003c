"""The chart's EXACT vLLM command line starts a real OpenAI-compatible vLLM server with target + draft.

The container of the rendered Deployment (values: ci/cpu-values.yaml, i.e. the CPU flags come from
the chart's own ``vllm.extraArgs``/``vllm.env``, nothing is added here) is run as a local process:
its command with this interpreter, its args with the model mount path ``/mnt/models`` replaced by a
local directory holding ``target/`` (a tiny real Qwen3) and ``draft/`` (written by
``peagle draft init``, in-process: an untrained draft has the trained one's format), and its env.
A chat request through ``peagle.deploy.smoke`` must succeed and ``/metrics`` must show vLLM's
spec-decode counters for K positions. One server start (~60-90 s on 2 CPU cores).
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import urllib.request

import pytest
import yaml

from support.k8s_schemas import ROOT
from support.vllm_server import free_port, wait_healthy
from peagle.cli import main as peagle_main
from peagle.deploy import render
from peagle.deploy.smoke import chat, metrics, require_model

pytestmark = pytest.mark.vllm
CHART = ROOT / "charts" / "peagle-serving"
K = 3


def counter(text: str, name: str) -> float:
    vals = [float(v) for v in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M)]
    assert vals, f"{name} not in /metrics"
    return sum(vals)


def test_rendered_vllm_command_serves_target_and_draft(qwen3_target, tmp_path):
    root = tmp_path / "mnt-models"
    root.mkdir()
    (root / "target").symlink_to(qwen3_target, target_is_directory=True)
    assert peagle_main(["draft", "init", "--target", str(qwen3_target), "--out", str(root / "draft"),
                        "--arch", "qwen3", "--num-layers", "1", "--num-depths", str(K)]) == 0

    port = free_port()
    values = yaml.safe_load((CHART / "ci" / "cpu-values.yaml").read_text())
    values["vllm"]["port"] = port
    values["speculative"] = {"numSpeculativeTokens": K}
    objs = {o["kind"]: o for o in render(values, "tiny-peagle", "ml", CHART)}
    container = objs["Deployment"]["spec"]["template"]["spec"]["containers"][0]
    mount = values.get("models", {}).get("root", "/mnt/models")
    assert "--enforce-eager" in container["args"]  # the chart carries the CPU flag itself

    cmd = [sys.executable, *container["command"][1:]] + [a.replace(mount, str(root)) for a in container["args"]]
    assert cmd[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    spec = json.loads(next(a for a in cmd if a.startswith("--speculative-config=")).split("=", 1)[1])
    assert spec["model"] == str(root / "draft") and f"--model={root / 'target'}" in cmd
    env = {**os.environ, **{e["name"]: e["value"] for e in container["env"]}}
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "1" and env["HF_HUB_OFFLINE"] == "1"

    log = tmp_path / "vllm.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url, log)
        # the served name, and the one naming the draft (its fingerprint is also the pods' label)
        fingerprint = objs["Deployment"]["spec"]["template"]["metadata"]["labels"]["peagle.io/draft-fingerprint"]
        with urllib.request.urlopen(url + "/v1/models", timeout=10) as resp:
            assert [m["id"] for m in json.loads(resp.read())["data"]] == ["tiny-peagle", f"tiny-peagle:draft-{fingerprint}"]
        require_model(url, f"tiny-peagle:draft-{fingerprint}")
        for prompt, model in (("Say hello in five words.", "tiny-peagle"),
                              ("Write a function that sums a list.", f"tiny-peagle:draft-{fingerprint}"),
                              ("What does argparse do?", "tiny-peagle")):
            reply = chat(url, model, prompt=prompt, max_tokens=24)
            assert reply["choices"][0]["message"]["content"] is not None
            assert reply["usage"]["completion_tokens"] > 0
        text = metrics(url)
        drafts = counter(text, "vllm:spec_decode_num_drafts_total")
        assert drafts > 0
        assert counter(text, "vllm:spec_decode_num_draft_tokens_total") == K * drafts
        per_pos = re.findall(r'^vllm:spec_decode_num_accepted_tokens_per_pos_total{[^}]*position="(\d+)"[^}]*} ',
                             text, re.M)
        assert sorted({int(p) for p in per_pos}) == list(range(K))
        assert counter(text, "vllm:spec_decode_num_accepted_tokens_total") >= 0
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
