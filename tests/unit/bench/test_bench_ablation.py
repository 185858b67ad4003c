"""bench/bench_ablation.py in-process: its arguments, variants and data mix, so the ablation runner cannot
rot between real runs. The whole --dry-run (variants trained in their own processes) is
tests/integration/processes/test_bench_ablation_runs.py.
"""
from __future__ import annotations

import pytest
from support.bench_scripts import load_bench


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
def test_bad_arguments_are_usage_errors(qwen3_target, tmp_path, capsys, monkeypatch, args, message):
    m = _module()
    started = []  # the default variants before a bad one would train in their own processes: not here
    monkeypatch.setattr(m, "run_logged", lambda argv, log, timeout: started.append(argv) or (1, 0.0))
    code = m.main(["--dry-run", "--target", str(qwen3_target), "--data", str(tmp_path),
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
    ids = sorted(r.sample_id for r in read_rows(tmp_path / "mix" / "data", "train"))
    assert ids == ["conv/a", "conv/b", "conversations/conv/a", "conversations/conv/b"], ids  # 2 + 2 rows
    assert open_hidden_states(hidden).num_samples == 4
    # built once: a second call reuses the published dataset
    assert _module().mixed_dataset(run, tmp_path / "mix") == hidden
