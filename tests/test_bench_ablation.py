"""bench/bench_ablation.py --dry-run on CPU, so the ablation runner cannot rot between real runs.

The dry run builds a tiny hidden-state dataset from ShareGPT rows (transformers backend), trains two
variants of the embedded recipe for 2 steps in their own processes, validates their evaluation
configurations and loads the held-out prompts; vLLM is not started.
"""
from __future__ import annotations

import subprocess
import sys

import pytest
import yaml
from bench_scripts import BENCH, load_bench

SCRIPT = BENCH / "bench_ablation.py"


def _run(*args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.integration  # two real training processes and an extraction
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


def _module():
    return load_bench("bench_ablation")


@pytest.mark.parametrize("args, message", [
    (["--variant", "x:train.optimizer=lion"], "optimizer"),
    (["--variants", "nope"], "unknown variant 'nope'"),
    (["--variant", "x:lr=1"], "is not draft.<key>=<value>"),
    (["--variant", "x:train.bogus=1"], "bogus"),
    (["--variant", "x:data.bogus=1"], "the data keys are data.human_replies"),
    (["--variants", "data-mix"], "data.human_replies needs --run"),
])
def test_bad_arguments_are_usage_errors(qwen3_target, tmp_path, capsys, args, message):
    code = _module().main(["--dry-run", "--target", str(qwen3_target), "--data", str(tmp_path),
                           "--work", str(tmp_path / "w"), *args])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("bench_ablation: error: ") and message in err, err


def test_variants_are_the_recipe_plus_their_overrides(qwen3_target, tmp_path):
    m = _module()
    cfg = m.config_for({"train.loss": "ce"}, str(qwen3_target), str(tmp_path), tmp_path / "o", epochs=1, max_steps=None)
    assert cfg["train"]["loss"] == "ce" and cfg["train"]["epochs"] == 1 and cfg["train"]["lr"] == 3e-3
    assert cfg["draft"]["num_depths"] == 4 and cfg["train"]["data"] == str(tmp_path)
    assert cfg["draft"]["draft_vocab_size"] is None  # the tiny target has fewer ids than the recipe's 8192
    assert m.parse_variant("a:train.lr=1e-3,draft.num_layers=2") == ("a", {"train.lr": 1e-3, "draft.num_layers": 2})


def test_data_mix_is_the_runs_on_policy_rows_plus_the_human_replies(qwen3_target, tmp_path):
    """data.human_replies: the regenerated conversations and the source's own replies of the same
    conversations, prepared with the run's prepare section and extracted with its extract section."""
    import json

    from peagle.data import PrepareSettings, read_rows
    from peagle.extract.reader import open_hidden_states

    conversations = [{"id": c, "conversations": [{"from": "human", "value": f"Question {c}?"},
                                                 {"from": "gpt", "value": f"The human answer to {c}."}]}
                     for c in ("a", "b", "c")]
    source = tmp_path / "conv.jsonl"
    source.write_text("".join(json.dumps(c) + "\n" for c in conversations))
    run = tmp_path / "run"
    (run / "regenerated").mkdir(parents=True)
    (run / "models").mkdir()
    (run / "models" / "target").symlink_to(qwen3_target)
    (run / "regenerated" / "conversations.jsonl").write_text("".join(json.dumps(
        {"id": f"conv/{c}", "source": "conv", "messages": [{"role": "user", "content": f"Question {c}?"},
                                                          {"role": "assistant", "content": f"On-policy {c}."}]}) + "\n"
        for c in ("a", "b")))
    prepare = PrepareSettings(sources=[str(source)], max_length=64, max_samples=2).model_dump(mode="json")
    (run / "run.json").write_text(json.dumps({"config": {
        "prepare": prepare, "regenerate": {"sources": [str(source)], "max_conversations": 3},
        "extract": {"backend": "hf", "dtype": "float32"}}}))
    hidden = _module().mixed_dataset(run, tmp_path / "mix")
    ids = sorted(r["sample_id"] for r in read_rows(tmp_path / "mix" / "data", "train"))
    assert ids == ["conv/a", "conv/b", "conversations/conv/a", "conversations/conv/b"], ids  # 2 + 2 rows
    assert open_hidden_states(hidden).num_samples == 4
    # built once: a second call reuses the published dataset
    assert _module().mixed_dataset(run, tmp_path / "mix") == hidden
