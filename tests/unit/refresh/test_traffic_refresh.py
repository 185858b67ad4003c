"""The refresh (peagle.refresh.selection, peagle.refresh.steps): a traffic window into a candidate draft.

Selection on synthetic records; the steps on the tiny target (hf extraction, a few training steps, the
gate replaced by a stand-in: the real one is a vLLM job, tested with peagle.gate.run).
"""
from __future__ import annotations

import json
import types
from datetime import datetime, timedelta, timezone

import pytest

from peagle.data import PrepareSettings, run_prepare
from peagle.data.output import PreparedData
from peagle.evaluate.prompts import load_prompt_sets
from peagle.model.target import fingerprint
from peagle.run_config import RunConfig
from peagle.traffic.log import TrafficWriter
from peagle.records.traffic import TrafficRecord
from peagle.commands.refresh import main
from peagle.refresh.steps import RefreshLayout, lineage_step, prepare_step, refresh, replay_count, select_step
from peagle.refresh.selection import (TrafficSelectionError, prompt_row, select_traffic, template_key,
                                      write_selection)
from peagle.traffic.settings import CaptureSettings, RefreshSettings
from support.traffic_records import traffic_record

T0 = datetime(2026, 12, 3, 12, 0, tzinfo=timezone.utc)
TARGET_FP = "t" * 64


def record(i: int, *, fp: str | None = TARGET_FP, status: int = 200, response: str | None = None,
           temperature: float = 0.0, prompt: str | None = None, when: datetime | None = None,
           endpoint: str = "/v1/chat/completions") -> TrafficRecord:
    return traffic_record(
        prompt or f"Question {i}: what is {i} plus {i}?", when=when or T0 + timedelta(seconds=i), endpoint=endpoint,
        sampling={"temperature": temperature}, status=status, finish_reason="stop", target_fingerprint=fp,
        response_text=f"The answer is {2 * i}." if response is None else response)


def settings(**kw) -> RefreshSettings:
    return RefreshSettings(**{"heldout_fraction": 0.25, "min_heldout": 2, **kw})


# ---------------------------------------------------------------------------------------------
# Selection


def test_cleaning_counts_every_dropped_record():
    good = [record(i) for i in range(12)]
    records = [*good, record(20, status=500), record(21, response="  "), record(22, fp="other"),
               record(23, fp=None), record(24, endpoint="/v1/completions"),
               record(25, prompt=good[3].messages[0]["content"], response=good[3].response_text)]  # a repeat
    sel = select_traffic(records, target_fingerprint=TARGET_FP, settings=settings())
    c = sel.counts
    assert (c["read"], c["failed"], c["other_target"], c["unknown_target"], c["completions_endpoint"],
            c["duplicates"]) == (18, 2, 1, 1, 1, 1)
    assert c["usable"] == 12 and c["heldout"] + c["train"] == 12
    kept = {r.id for r in sel.train + sel.heldout}
    assert kept == {r.id for r in good}


def test_newest_slice_is_held_out_and_never_trained_on():
    records = [record(i) for i in range(20)]
    sel = select_traffic(list(reversed(records)), target_fingerprint=TARGET_FP, settings=settings())
    assert len(sel.heldout) == 5  # ceil(0.25 * 20)
    assert max(r.received_at_dt for r in sel.train) < min(r.received_at_dt for r in sel.heldout)
    assert [r.id for r in sel.heldout] == [r.id for r in records[-5:]]
    # at least min_heldout, whatever the fraction
    sel = select_traffic(records, target_fingerprint=TARGET_FP, settings=settings(min_heldout=8))
    assert len(sel.heldout) == 8 and len(sel.train) == 12


def test_a_timestamp_tie_at_the_boundary_joins_the_heldout_slice():
    records = [record(i) for i in range(8)] + [record(i, when=T0 + timedelta(seconds=8)) for i in range(8, 12)]
    sel = select_traffic(records, target_fingerprint=TARGET_FP, settings=settings())
    assert len(sel.heldout) == 4 and len(sel.train) == 8  # ceil(0.25 * 12) = 3, the fourth tied record joins
    records.append(record(12, when=T0 + timedelta(seconds=7)))
    sel = select_traffic(records, target_fingerprint=TARGET_FP, settings=settings())
    assert max(r.received_at_dt for r in sel.train) < min(r.received_at_dt for r in sel.heldout)


def test_heldout_prompts_leave_training_and_repeat_once():
    ask = "Explain recursion briefly."
    records = [record(i, prompt=ask if i in (1, 11, 12) else None, response=f"Answer {i}.") for i in range(15)]
    sel = select_traffic(records, target_fingerprint=TARGET_FP, settings=settings(min_heldout=4))
    # the newest 4 (11-14) hold 3 distinct prompts: the slice grows back to record 10 for the fourth
    assert [r.messages[0]["content"] for r in sel.heldout].count(ask) == 1 and len(sel.heldout) == 4
    assert sel.counts["heldout_duplicate_prompts"] == 1 and sel.counts["train_heldout_prompts"] == 1
    assert ask not in [r.messages[0]["content"] for r in sel.train] and len(sel.train) == 9


def test_a_template_cap_keeps_the_newest_training_records_of_each_instruction():
    """refresh.max_per_template (issue #40): one client's instruction wrapped around many inputs counts as one
    template; only its newest records train, other templates and the held-out slice are untouched."""
    wrapped = "Complete the following Python function. Answer with the whole function in a code block.\n\ndef f{}():"
    records = [record(i, prompt=wrapped.format(i) if i % 3 else None, response=f"Answer {i}.") for i in range(24)]
    free = select_traffic(records, target_fingerprint=TARGET_FP, settings=settings())
    sel = select_traffic(records, target_fingerprint=TARGET_FP, settings=settings(max_per_template=3))
    assert [r.id for r in sel.heldout] == [r.id for r in free.heldout]  # the held-out slice is not capped
    trained_wrapped = [r for r in sel.train if r.messages[0]["content"].startswith("Complete")]
    free_wrapped = [r for r in free.train if r.messages[0]["content"].startswith("Complete")]
    assert [r.id for r in trained_wrapped] == [r.id for r in free_wrapped[-3:]]  # the newest three
    # "Question {i}: what is ..." -- digits masked: one template too
    assert len([r for r in sel.train if r.messages[0]["content"].startswith("Question")]) == 3
    assert sel.counts["template_capped"] == len(free.train) - len(sel.train) > 0
    assert template_key([{"role": "user", "content": "  \nQuestion 12: x\nmore"}]) == "question 0: x"


@pytest.mark.parametrize("policy,trained,regenerate", [("keep", 9, 0), ("drop", 6, 0), ("regenerate", 9, 3)])
def test_sampled_responses(policy, trained, regenerate):
    records = [record(i, temperature=0.7 if i % 3 == 0 else 0.0) for i in range(12)]
    sel = select_traffic(records, target_fingerprint=TARGET_FP, settings=settings(sampled_responses=policy))
    assert len(sel.train) == trained and len(sel.regenerate) == regenerate
    assert sel.counts["sampled"] == 3
    assert sel.counts["sampled_dropped"] == (3 if policy == "drop" else 0)
    assert len(sel.heldout) == 3  # the held-out slice keeps sampled records: the gate sends their prompts


def test_too_little_traffic_names_the_counts():
    records = [record(i, fp="other") for i in range(30)] + [record(40)]
    with pytest.raises(TrafficSelectionError, match=r"read=31.*other_target=30"):
        select_traffic(records, target_fingerprint=TARGET_FP, settings=settings())


def test_records_dated_after_now_are_counted_as_future_and_never_end_the_window():
    now = T0 + timedelta(hours=1)
    future = [record(100 + i, when=datetime(9999, 12, 31, tzinfo=timezone.utc)) for i in range(20)]
    sel = select_traffic(future + [record(i) for i in range(60)], target_fingerprint=TARGET_FP, settings=settings(),
                         now=now)
    assert sel.counts["future"] == 20 and sel.counts["usable"] == 60
    assert all(r.received_at_dt < now for r in sel.train + sel.heldout)
    assert sel.window()["heldout"]["last_received_at"] == record(59).received_at


def test_one_prompt_repeated_thousands_of_times_does_not_block_the_refresh():
    """A client repeating one older prompt 3000 times (varied responses): the held-out slice is sized by
    distinct prompts, so it is the newest 16 of the 61, and the rest trains."""
    flood = [record(i, prompt="Say something.", response=f"Something {i}.", when=T0 - timedelta(hours=1, seconds=-i))
             for i in range(3000)]
    good = [record(i) for i in range(60)]
    sel = select_traffic(flood + good, target_fingerprint=TARGET_FP, settings=settings(min_heldout=16))
    assert [r.id for r in sel.heldout] == [r.id for r in good[-16:]]  # ceil(0.25 * 61 prompts) = 16
    assert len(sel.train) == 3000 + 44 and sel.counts["train_heldout_prompts"] == 0
    # every record the same prompt: no prompt left to train on, named by the count of distinct prompts
    with pytest.raises(TrafficSelectionError, match="1 distinct prompts"):
        select_traffic(flood, target_fingerprint=TARGET_FP, settings=settings())


def test_selection_files(tmp_path):
    sel = select_traffic([record(i, temperature=0.5 if i == 0 else 0.0) for i in range(12)],
                         target_fingerprint=TARGET_FP, settings=settings(sampled_responses="regenerate"))
    paths = write_selection(sel, tmp_path)
    train = [json.loads(line) for line in paths["train.jsonl"].read_text().splitlines()]
    assert len(train) == len(sel.train) - 1  # the sampled one waits in regenerate.jsonl
    assert train[0]["messages"][-1] == {"role": "assistant", "content": sel.train[1].response_text}
    assert len(paths["regenerate.jsonl"].read_text().splitlines()) == 1
    sets = load_prompt_sets([str(paths["heldout.jsonl"])])
    assert [p.id for p in sets["traffic"].prompts] == [prompt_row(r)["id"] for r in sel.heldout]
    summary = json.loads(paths["counts.json"].read_text())
    assert summary["counts"] == sel.counts
    assert summary["window"]["heldout"]["last_received_at"] == sel.heldout[-1].received_at


# ---------------------------------------------------------------------------------------------
# Steps on the tiny target


def write_traffic(uri, records) -> str:
    w = TrafficWriter(CaptureSettings(enabled=True, uri=str(uri), redact=[], retention_days=0, batch_records=1000))
    for r in records:
        assert w.submit(r)
    assert w.close()
    return str(uri)


def conversations(n: int, word: str) -> list[dict]:
    return [{"id": f"{word}{i}", "messages": [{"role": "user", "content": f"{word} {i}: what is {i} times two?"},
                                              {"role": "assistant", "content": f"{i} times two is {2 * i}."}]}
            for i in range(n)]


@pytest.fixture(scope="module")
def base_data(qwen3_target, tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("base")
    src = root / "base.jsonl"
    src.write_text("".join(json.dumps(c) + "\n" for c in conversations(40, "Base")))
    run_prepare(PrepareSettings(sources=[str(src)], validation_fraction=0.0), qwen3_target, root / "data")
    return str(root / "data")


TINY = {"prepare": {"validation_fraction": 0.0, "max_length": 128},
        "extract": {"backend": "hf", "samples_per_shard": 8},
        "draft": {"num_depths": 2, "draft_vocab_size": 128, "aux_layer_ids": [1, 3, 5]},
        "train": {"row_tokens": 128, "global_batch_rows": 2, "max_steps": 2, "val_fraction": 0.0}}


def tiny_config(traffic: str, base: str, **refresh) -> RunConfig:
    return RunConfig.model_validate({**TINY, "refresh": {"traffic": traffic, "base_data": base, "min_heldout": 4,
                                                         **refresh}})


def target_records(target, n: int) -> list[TrafficRecord]:
    fp = fingerprint(target)
    return [record(i, fp=fp) for i in range(n)] + [record(100 + i, fp="another target") for i in range(3)]


def test_select_and_prepare_mix_the_replay_fraction(qwen3_target, base_data, tmp_path):
    traffic = write_traffic(tmp_path / "traffic", target_records(qwen3_target, 16))
    cfg = tiny_config(traffic, base_data, replay_fraction=0.25)
    layout = RefreshLayout.of(str(tmp_path / "refresh"))
    summary = select_step(cfg, target=str(qwen3_target), layout=layout)
    assert summary["counts"]["other_target"] == 3 and summary["counts"]["train"] == 12
    data = prepare_step(cfg, target=str(qwen3_target), layout=layout)
    assert data["traffic_rows"]["train"] == 12
    assert data["replayed_rows"] == {"train": replay_count(12, 0.25), "validation": 0} == {"train": 4, "validation": 0}
    merged = PreparedData.open(layout.data)
    ids = [r.sample_id for r in merged.rows("train")]
    assert len(ids) == 16 and len(set(ids)) == 16
    assert sum(i.startswith("replay/") for i in ids) == 4  # a quarter of the final rows
    assert merged.header.counts["train"] == 16 and merged.header.metadata["refresh"]["replayed_rows"]["train"] == 4
    # deterministic: the same seed draws the same base rows
    prepare_step(cfg, target=str(qwen3_target), layout=layout)
    assert [r.sample_id for r in PreparedData.open(layout.data).rows("train")] == ids


def test_replay_needs_base_data(qwen3_target, tmp_path):
    traffic = write_traffic(tmp_path / "traffic", target_records(qwen3_target, 16))
    layout = RefreshLayout.of(str(tmp_path / "refresh"))
    cfg = tiny_config(traffic, "")
    select_step(cfg, target=str(qwen3_target), layout=layout)
    with pytest.raises(ValueError, match="--base-data"):
        prepare_step(cfg, target=str(qwen3_target), layout=layout)


@pytest.fixture(scope="module")
def serving_draft(qwen3_target, tmp_path_factory) -> str:
    """An (untrained) published draft of the tiny target, in the shape TINY configures."""
    from peagle.cli import main as peagle_main

    out = tmp_path_factory.mktemp("serving") / "draft"
    assert peagle_main(["draft", "init", "--target", str(qwen3_target), "--out", str(out), "--num-depths", "2",
                        "--draft-vocab-size", "128", "--aux-layer-ids", "1", "3", "5"]) == 0
    return str(out)


def test_refresh_without_traffic_of_the_target_exits_2_naming_the_counts(qwen3_target, serving_draft, tmp_path,
                                                                          capsys):
    traffic = write_traffic(tmp_path / "traffic", [record(i, fp="another target") for i in range(20)])
    code = main(["--target", str(qwen3_target), "--serving-draft", serving_draft, "--traffic", traffic,
                 "--out", str(tmp_path / "out"), "--set", "refresh.replay_fraction=0"])
    assert code == 2
    err = capsys.readouterr().err
    assert "read=20" in err and "other_target=20" in err


def test_a_serving_draft_that_is_not_one_stops_the_refresh_first(qwen3_target, tmp_path, capsys):
    code = main(["--target", str(qwen3_target), "--serving-draft", str(tmp_path / "nothing"), "--traffic",
                 str(tmp_path / "traffic"), "--out", str(tmp_path / "out")])
    assert code == 2 and "nothing" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_select_step_leaves_out_records_dated_in_the_future(qwen3_target, tmp_path):
    """An empty refresh.until is now: records dated 9999 are counted as future, never the window's end."""
    fp = fingerprint(qwen3_target)
    now = datetime.now(timezone.utc)
    future = [record(100 + i, fp=fp, when=datetime(9999, 12, 31, tzinfo=timezone.utc)) for i in range(20)]
    traffic = write_traffic(tmp_path / "traffic", future + [record(i, fp=fp, when=now - timedelta(minutes=90 - i))
                                                            for i in range(60)])
    summary = select_step(tiny_config(traffic, ""), target=str(qwen3_target),
                          layout=RefreshLayout.of(str(tmp_path / "refresh")))
    assert summary["counts"]["future"] == 20 and summary["counts"]["usable"] == 60
    assert summary["window"]["heldout"]["last_received_at"] < summary["selected_at"]


@pytest.mark.parametrize("case", ["base_data_inside_out", "out_is_a_prepared_dataset", "out_holds_user_files",
                                  "draft_over_the_serving_draft"])
def test_a_refresh_out_that_would_replace_data_is_refused_before_any_work(qwen3_target, base_data, serving_draft,
                                                                           tmp_path, capsys, case):
    import shutil

    run = tmp_path / "run"
    if case == "base_data_inside_out":  # refresh --base-data RUN/data --out RUN: its own base data
        shutil.copytree(base_data, run / "data")
        base, out = run / "data", run
    elif case == "out_is_a_prepared_dataset":
        shutil.copytree(base_data, run)
        base, out = base_data, run
    elif case == "out_holds_user_files":
        run.mkdir()
        (run / "notes.txt").write_text("mine")
        base, out = base_data, run
    else:  # the serving draft is <out>/draft
        shutil.copytree(serving_draft, run / "draft")
        base, out = base_data, run
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    traffic = write_traffic(tmp_path / "traffic", target_records(qwen3_target, 16))
    code = main(["--target", str(qwen3_target), "--serving-draft", str(run / "draft" if case.startswith("draft")
                                                                         else serving_draft),
                 "--traffic", traffic, "--base-data", str(base), "--out", str(out), "--trigger"])
    assert code == 2 and "refusing" in capsys.readouterr().err
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before  # nothing written, nothing lost


def test_the_refresh_trains_with_its_own_levers_and_refuses_them_in_train(tmp_path, monkeypatch):
    """The refresh's recipe (refresh.epochs, default 2; refresh.lr_scale 0.3 of the run's lr, re-warmed over
    refresh.warmup_steps 25; refresh.anchor_weight, default 1: a KL term to the serving draft;
    refresh.rejected_weight) sets the training's; the same lever set in train is refused, naming where it
    belongs, so one key decides."""
    import peagle.train as train_module
    from peagle.config import ConfigError
    from peagle.refresh.steps import train_step

    seen = {}

    def stop(run):
        seen.update(init_from=run.train.init_from, anchor=run.train.anchor_weight, rejected=run.train.rejected_weight,
                    epochs=run.train.epochs, lr=run.train.lr, warmup=run.train.warmup_steps)
        raise KeyboardInterrupt  # the run config is what this test reads: no training

    monkeypatch.setattr(train_module, "train", stop)
    layout = RefreshLayout.of(str(tmp_path / "refresh"))
    for refresh_levers, expected in (({}, (1.0, 0.0, 2)),
                                     ({"anchor_weight": 0.0, "rejected_weight": 2.0, "epochs": 1}, (0.0, 2.0, 1))):
        with pytest.raises(KeyboardInterrupt):
            train_step(tiny_config("traffic", "", **refresh_levers), target="t", serving_draft="serving", layout=layout)
        assert (seen["init_from"], seen["anchor"], seen["rejected"], seen["epochs"]) == ("serving", *expected)
    base = tiny_config("traffic", "")
    for levers, lr, warmup in (({}, 0.3, 25), ({"lr_scale": 1.0, "warmup_steps": None}, 1.0, base.train.warmup_steps)):
        with pytest.raises(KeyboardInterrupt):
            train_step(tiny_config("traffic", "", **levers), target="t", serving_draft="s", layout=layout)
        assert seen["lr"] == pytest.approx(lr * base.train.lr) and seen["warmup"] == warmup  # the run's lr, scaled
    cfg = RunConfig.model_validate({**TINY, "train": {**TINY.get("train", {}), "anchor_weight": 0.5},
                                    "refresh": {"traffic": "traffic"}})
    with pytest.raises(ConfigError, match=r"train.anchor_weight=0.5 in a refresh: the refresh sets it from "
                                          r"refresh.anchor_weight; set that instead"):
        train_step(cfg, target="t", serving_draft="serving", layout=layout)


def test_refresh_end_to_end_with_a_stand_in_gate(qwen3_target, base_data, serving_draft, tmp_path, monkeypatch):
    """select -> prepare -> extract (hf) -> train warm-started from the serving draft -> gate -> lineage."""
    import peagle.gate.run as gate_module
    from peagle.model.adapter import Draft

    serving = serving_draft
    traffic = write_traffic(tmp_path / "traffic", target_records(qwen3_target, 16))
    calls = {}

    def run_gate(**kw):
        calls.update(kw)
        return types.SimpleNamespace(passed=False, reasons=["traffic_gain: +0.00 < margin 0.02"])

    monkeypatch.setattr(gate_module, "run_gate", run_gate)
    cfg = tiny_config(traffic, base_data, replay_fraction=0.2)
    outcome = refresh(cfg, target=str(qwen3_target), serving_draft=str(serving), out=str(tmp_path / "out"),
                      say=lambda line: None)
    layout = outcome.layout
    assert outcome.passed is False
    assert calls["candidate_draft"] == layout.draft and calls["serving_draft"] == str(serving)
    assert calls["traffic_prompts"].endswith("heldout.jsonl") and calls["general"] == cfg.gate.general
    lineage = json.loads(open(layout.lineage).read())
    assert lineage == outcome.lineage.to_dict()
    assert lineage["base_draft"]["fingerprint"] == Draft.open(str(serving)).identity.fingerprint
    assert lineage["candidate_draft"]["fingerprint"] == Draft.open(layout.draft).identity.fingerprint
    assert lineage["candidate_draft"]["fingerprint"] != lineage["base_draft"]["fingerprint"]
    assert lineage["target"]["fingerprint"] == fingerprint(qwen3_target)
    assert lineage["rows"]["traffic"]["train"] == 12 and lineage["rows"]["replayed"]["train"] == 3
    assert lineage["replay"] == {"fraction": 0.2, "base_data": base_data, "rows": {"train": 3, "validation": 0},
                                 "short": False}
    covered = lineage["traffic"]["covered"]
    assert covered["first_received_at"] == covered["train"]["first_received_at"]
    assert covered["last_received_at"] == covered["heldout"]["last_received_at"]
    assert covered["train"]["last_received_at"] < covered["heldout"]["first_received_at"]
    assert lineage["counts"]["other_target"] == 3
    assert lineage["gate"]["passed"] is False and lineage["gate"]["reasons"]
    # the lineage step alone (what the pipeline's last step runs) reads the same from the layout
    again = lineage_step(cfg, target=str(qwen3_target), serving_draft=str(serving), layout=layout, gate=None)
    assert again.gate is None and again.rows == lineage["rows"]
    # each lineage step appended a refresh to the loop history: the next trigger counts new traffic from its end
    from peagle.records.base import parse_time
    from peagle.records.history import LoopHistory

    first, second = LoopHistory(f"{traffic}/_loop").all("refresh")
    assert first["verdict"] == "rejected" and second["verdict"] is None and first["refresh_uri"] == layout.root
    assert first["candidate"]["fingerprint"] == lineage["candidate_draft"]["fingerprint"]
    assert first["window"]["last_received_at"] == covered["last_received_at"]
    assert parse_time(first["window"]["until"]) > parse_time(covered["last_received_at"])


def test_sampled_responses_regenerated_by_the_target_are_trained_on(qwen3_target, base_data, tmp_path, monkeypatch):
    """refresh.sampled_responses=regenerate: the regenerate stage (greedy) answers the sampled records again;
    prepare then reads its output beside the greedy records (the stage itself is tested with vLLM elsewhere)."""
    import peagle.data.regenerate as regenerate_module

    seen = {}

    def run_regenerate(settings, target, output, **kw):
        seen.update(settings=settings, target=target)
        rows = [json.loads(line) for line in open(settings.sources[0])]
        with open(output, "w") as fh:
            for row in rows:
                row["messages"][-1]["content"] = "A greedy answer."
                fh.write(json.dumps(row) + "\n")
        return regenerate_module.RegenerateResult(output, {"regenerated": len(rows)})

    monkeypatch.setattr(regenerate_module, "run_regenerate", run_regenerate)
    fp = fingerprint(qwen3_target)
    traffic = write_traffic(tmp_path / "traffic", [record(i, fp=fp, temperature=0.8 if i < 4 else 0.0)
                                                   for i in range(16)])
    cfg = tiny_config(traffic, base_data, replay_fraction=0.0, sampled_responses="regenerate")
    cfg.regenerate.max_prompt_tokens = 128  # the run's own cap must not cut prompts the target already served
    layout = RefreshLayout.of(str(tmp_path / "refresh"))
    summary = select_step(cfg, target=str(qwen3_target), layout=layout)
    assert seen["settings"].temperature == 0.0 and seen["target"] == str(qwen3_target)
    assert seen["settings"].max_prompt_tokens is None
    assert summary["regenerated"] == {"regenerated": 4} and summary["counts"]["sampled_regenerate"] == 4
    data = prepare_step(cfg, target=str(qwen3_target), layout=layout)
    assert data["traffic_rows"]["train"] == 12 and data["replayed_rows"]["train"] == 0
    sources = {r.split("/")[0] for r in (row.sample_id for row in PreparedData.open(layout.data).rows("train"))}
    assert sources == {"train", "regenerated"}
