"""Regeneration with a chat template that never finishes rendering, through a real vLLM engine: the run
ends with exit 2 naming the target and ``prepare.template_time_limit_s``, not a hang."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from support.regenerate_templates import endless_target_copy


@pytest.fixture(scope="module")
def endless_target(qwen3_target, tmp_path_factory) -> Path:
    return endless_target_copy(qwen3_target, tmp_path_factory.mktemp("endless") / "target")


@pytest.mark.vllm
def test_regenerate_with_an_endless_template_ends_with_exit_2_naming_the_target_and_limit(endless_target, tmp_path,
                                                                                         capsys):
    from peagle.cli import main

    f = tmp_path / "chats.jsonl"
    f.write_text(json.dumps({"id": "a", "messages": [{"role": "user", "content": "hi"},
                                                      {"role": "assistant", "content": "hello"}]}) + "\n")
    rc = main(["regenerate", "--target", str(endless_target), "--set", f"regenerate.sources=[{f}]",
               "--set", "prepare.template_time_limit_s=0.5", "--set", "regenerate.max_tokens=4",
               "--set", "regenerate.engine.timeout_s=900",  # a render without end: killed, not a hung test
               "--out", str(tmp_path / "r.jsonl")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err[-1].startswith("peagle: error: "), err
    assert f"target {endless_target}" in err[-1] and "0.5 s" in err[-1] and "template_time_limit_s" in err[-1]
