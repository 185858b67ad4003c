"""Training engine pieces: teacher alignment, loss, packing and sharding, split, schedule, prefetch,
checkpoint selection, configuration, and refusals of bad input before step 1."""
from __future__ import annotations

import json
import math
import threading
from pathlib import Path

import pytest
import torch
import yaml

from peagle.config import ConfigError, DraftSettings, build_config
from peagle.model import init_draft
from peagle.model.elements import shift_row
from peagle.model.target import inspect_target, read_target_tensors
from peagle.model.teacher import Teacher
from peagle.storage import PrefixWriter, open_store
from peagle.train import (DatasetError, DatasetInfo, ListDataset, SampleFileDataset, TrainRunConfig, train,
                          write_sample_file)
from peagle.train.__main__ import main as train_main
from peagle.train.batches import Prefetcher, pack_samples, plan_run, prepare_row, rank_rows, row_seed
from peagle.train.checkpoint import ResumeError, latest_complete, step_prefix
from peagle.train.cod import sample_elements
from peagle.train.data import is_validation, split_indices
from peagle.train.loss import EPS, metrics_from_stats, per_element_loss, row_loss
from peagle.train.optim import lr_factor
from support.train_data import _load, target_dataset, tiny_config


@pytest.fixture(scope="module")
def dataset(qwen3_target) -> ListDataset:
    return target_dataset(qwen3_target, 24, seed=3)


# ---------------------------------------------------------------------------------------------
# Teacher and loss


def test_teacher_rebuilds_the_target_distribution_at_each_target_row(qwen3_target, dataset):
    """Shift + COD + teacher (final norm, pruned head) == the target's own logits one position on."""
    draft = init_draft(str(qwen3_target), DraftSettings(num_layers=1, num_depths=3, draft_vocab_size=256))
    info = inspect_target(qwen3_target)
    norm = read_target_tensors(info.path, {"n": ("model.norm.weight",)})["n"]
    teacher = Teacher(norm, draft.lm_head.weight, info.config.rms_norm_eps)
    s = dataset[0]
    n = s["input_ids"].shape[0]
    packed = pack_samples([(s, n)], 1, torch.float32)
    row = shift_row(packed["input_ids"], packed["aux_hidden"], packed["loss_mask"], packed["document_ids"],
                    packed["last_hidden"])
    el = sample_elements(row, 3, torch.Generator().manual_seed(5), max_anchors=None)
    assert el.depth_counts(3)[1] > 0 and el.depth_counts(3)[2] > 0
    _, hf = _load(str(qwen3_target))
    with torch.no_grad():
        target_logits = hf(input_ids=s["input_ids"][None]).logits[0]  # [n, V]: position p predicts x_{p+1}
    expected = target_logits[el.target_rows + 1][:, draft.t2d]
    got = teacher(row.teacher_hidden[el.target_rows])
    torch.testing.assert_close(got, expected, atol=2e-4, rtol=1e-4)

    prepared = prepare_row([(s, n)], num_depths=3, generator=torch.Generator().manual_seed(5), cod_ratio=0.7,
                           cod_ratio_min=0.2, max_anchors=None, pad_to_multiple=1, hidden_dtype=torch.float32,
                           dense_layer_types=["full_attention"], sliding_window=None)
    sup = el.loss_mask.nonzero().squeeze(1)
    assert torch.equal(prepared.supervised, sup)
    assert torch.equal(prepared.teacher_hidden, row.teacher_hidden[el.target_rows[sup]])
    assert prepared.dense_masks["full_attention"].shape == (1, 1, len(el), len(el))


def test_kl_and_ce_losses_and_pooled_metrics():
    g = torch.Generator().manual_seed(0)
    draft, teacher = torch.randn(7, 11, generator=g), torch.randn(7, 11, generator=g) * 3
    p, q = teacher.softmax(-1), draft.softmax(-1)
    kl = (p * (p.log() - q.log())).sum(-1)
    torch.testing.assert_close(per_element_loss(draft, teacher, "kl"), kl)
    ce = -q.log()[torch.arange(7), teacher.argmax(-1)]
    torch.testing.assert_close(per_element_loss(draft, teacher, "ce"), ce)
    assert per_element_loss(teacher, teacher, "kl").abs().max() < 1e-5

    # Two rows pooled: Σ ℓ / (Σ m + eps) over all depths; accuracy per depth over its own elements.
    depths = torch.tensor([0, 0, 0, 1, 1, 2, 2])
    a = row_loss(draft[:4], teacher[:4], depths[:4], 3, "kl")
    b = row_loss(draft[4:], teacher[4:], depths[4:], 3, "kl")
    m = metrics_from_stats(a.stats + b.stats)
    assert m["loss"] == pytest.approx(kl.sum().item() / (7 + EPS), rel=1e-6)
    hit = (draft.argmax(-1) == teacher.argmax(-1)).float()
    for d in range(3):
        assert m[f"position_{d}_acc"] == pytest.approx(hit[depths == d].mean().item())
    assert m["full_acc"] == pytest.approx(hit.mean().item())
    empty = row_loss(draft[:0].requires_grad_(), teacher[:0], depths[:0], 3, "kl")
    empty.loss_sum.backward()  # a row without supervised elements still joins the backward pass
    assert math.isnan(metrics_from_stats(empty.stats)["position_0_acc"])


# ---------------------------------------------------------------------------------------------
# Data: packing, sharding, split


def test_plan_is_deterministic_packs_within_budget_and_shards_disjointly(dataset):
    train_idx = list(range(len(dataset)))
    kw = dict(row_tokens=100, global_batch_rows=4, epochs=3, seed=7)
    plan = plan_run(dataset, train_idx, **kw)
    assert plan == plan_run(dataset, train_idx, **kw)
    assert plan != plan_run(dataset, train_idx, **{**kw, "seed": 8})
    by_epoch = [[i for st in plan if st.epoch == e for row in st.rows for i, _ in row] for e in range(3)]
    assert by_epoch[0] != by_epoch[1]  # reshuffled every epoch
    for ids in by_epoch:
        assert len(ids) == len(set(ids))  # a sample at most once per epoch
    for st in plan:
        assert len(st.rows) == 4
        assert all(sum(n for _, n in row) <= 100 for row in st.rows)
        for world in (1, 2, 4):
            shards = [rank_rows(st, r, world) for r in range(world)]
            flat = sorted(i for shard in shards for i, _ in shard)
            assert flat == [0, 1, 2, 3]  # every row exactly once, on one rank
            samples = [{i for _, row in shard for i, _ in row} for shard in shards]
            assert sum(len(x) for x in samples) == len(set().union(*samples))  # ranks share no sample
    # COD seeds depend on the row's place in the global batch only, never on the rank that trains it.
    assert row_seed(7, "train", 0, 3, 2) == row_seed(7, "train", 0, 3, 2) != row_seed(7, "train", 0, 3, 1)


def test_packed_row_has_document_ids_and_padding(dataset):
    a, b = dataset[0], dataset[1]
    packed = pack_samples([(a, 10), (b, 7)], 8, torch.float32)
    docs = packed["document_ids"]
    assert docs.tolist() == [0] * 10 + [1] * 7 + [-1] * 7 and packed["num_tokens"] == 17
    assert torch.equal(packed["input_ids"][10:17], b["input_ids"][:7])
    assert not packed["loss_mask"][17:].any() and not packed["aux_hidden"][17:].any()
    row = shift_row(packed["input_ids"], packed["aux_hidden"], packed["loss_mask"], packed["document_ids"])
    assert row.document_ids[9] == -1 and not row.loss_mask[9]  # the boundary row pairs two documents: padding


def test_split_by_sample_id_is_stable(dataset):
    ids = [f"conv-{i}" for i in range(2000)]
    held = [i for i in ids if is_validation(i, 1, 0.1)]
    assert held == [i for i in ids if is_validation(i, 1, 0.1)]
    assert 150 < len(held) < 250
    assert held != [i for i in ids if is_validation(i, 2, 0.1)]
    assert not any(is_validation(i, 1, 0.0) for i in ids)
    train_idx, val_idx = split_indices(dataset, 0, 0.3)
    assert sorted(train_idx + val_idx) == list(range(len(dataset))) and val_idx


def test_sample_file_round_trip(tmp_path, dataset):
    f = write_sample_file(tmp_path / "s.safetensors", dataset.info, dataset.samples[:5])
    back = SampleFileDataset(f)
    assert back.info == dataset.info and len(back) == 5
    for i in range(5):
        assert back.sample_id(i) == dataset.sample_id(i) and back.num_tokens(i) == dataset.num_tokens(i)
        for key in ("input_ids", "aux_hidden", "last_hidden"):
            assert torch.equal(back[i][key], dataset[i][key])
        assert torch.equal(back[i]["loss_mask"].long(), dataset[i]["loss_mask"].long())


# ---------------------------------------------------------------------------------------------
# Schedule, prefetch, checkpoint selection, configuration


def test_lr_schedule_warms_up_then_decays():
    f = lambda step, sched: lr_factor(step, total_steps=100, warmup=10, schedule=sched, min_ratio=0.1)  # noqa: E731
    assert f(0, "cosine") == pytest.approx(0.1) and f(9, "cosine") == pytest.approx(1.0)
    assert f(10, "cosine") == pytest.approx(1.0) and f(100, "cosine") == pytest.approx(0.1)
    assert f(55, "cosine") == pytest.approx(0.55) and f(55, "linear") == pytest.approx(0.55)
    assert f(90, "linear") == pytest.approx(0.1 + 0.9 * 10 / 90) and f(90, "constant") == 1.0


def test_prefetcher_keeps_order_runs_ahead_and_reraises():
    seen, gate = [], threading.Event()

    def produce(i):
        seen.append(i)
        if i == 0:
            gate.wait(5)
        return i * i

    p = Prefetcher(list(range(6)), produce, depth=2)
    it = iter(p)
    gate.set()
    assert [next(it) for _ in range(6)] == [0, 1, 4, 9, 16, 25]
    p.close()

    def boom(i):
        if i == 2:
            raise DatasetError("sample 'x': broken")
        return i

    p = Prefetcher(list(range(5)), boom, depth=1)
    with pytest.raises(DatasetError, match="sample 'x'"):
        list(p)
    p.close()
    assert list(Prefetcher([1, 2], lambda i: -i, depth=0)) == [-1, -2]


def test_a_checkpoint_prefix_without_success_is_never_latest(tmp_path):
    store = open_store(tmp_path / "store")
    for step in (3, 6):
        w = PrefixWriter(store, step_prefix(step))
        w.put_bytes("trainer_state.json", b"{}")
        w.commit({"step": step})
    store.put_bytes(step_prefix(9) + "/model.safetensors", b"partial upload")  # killed before manifest/_SUCCESS
    w = PrefixWriter(store, step_prefix(12))
    w.put_bytes("trainer_state.json", b"{}")  # manifest never written either
    assert latest_complete(store) == (6, step_prefix(6))
    assert latest_complete(open_store(tmp_path / "empty")) is None


def test_config_builds_from_yaml_and_overrides(tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text(yaml.safe_dump({"target": {"path": "/t"}, "train": {"lr": 1e-3, "distributed": "fsdp"}}))
    cfg = build_config(TrainRunConfig, f, ["train.max_steps=7", "draft.num_depths=5"])
    assert cfg.train.lr == 1e-3 and cfg.train.max_steps == 7 and cfg.draft.num_depths == 5
    assert cfg.train.distributed == "fsdp" and cfg.train.betas == (0.9, 0.95)
    with pytest.raises(ConfigError, match="train.lerning_rate"):
        build_config(TrainRunConfig, f, ["train.lerning_rate=1"])
    with pytest.raises(ConfigError, match="cod_ratio_min"):
        build_config(TrainRunConfig, f, ["train.cod_ratio=0.1", "train.cod_ratio_min=0.5"])


# ---------------------------------------------------------------------------------------------
# Refusals before step 1


def _bad(sample: dict, **changes) -> dict:
    out = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in sample.items()}
    out.update(changes)
    return out


def _refusals(dataset: ListDataset):
    info, good = dataset.info, dataset.samples
    s3 = good[3]
    nan_aux = s3["aux_hidden"].clone()
    nan_aux[2, 5] = float("nan")
    big_ids = s3["input_ids"].clone()
    big_ids[1] = 100_000
    corrupt = lambda **ch: ListDataset(info, good[:3] + [_bad(s3, **ch)] + good[4:])  # noqa: E731
    return {
        "aux": (ListDataset(DatasetInfo([1, 4, 5], info.hidden_size, info.target_fingerprint), good),
                r"aux layer ids \[1, 4, 5\].*\[2, 4, 5\]"),
        "hidden": (ListDataset(DatasetInfo(info.aux_layer_ids, 128, info.target_fingerprint), good),
                   "hidden size 128.*256"),
        "fingerprint": (ListDataset(DatasetInfo(info.aux_layer_ids, info.hidden_size, "0" * 64), good),
                        "different target: target fingerprint '0000"),
        "empty": (ListDataset(info, []), "is empty"),
        "nan": (corrupt(aux_hidden=nan_aux), f"sample '{s3['sample_id']}': aux_hidden contains NaN"),
        "width": (corrupt(aux_hidden=s3["aux_hidden"][:, :700]),
                  f"sample '{s3['sample_id']}': aux_hidden has shape .*700.*768"),
        "token": (corrupt(input_ids=big_ids), "token id 100000 is outside the target vocabulary"),
        "mask": (corrupt(loss_mask=s3["loss_mask"][:-1]), "loss_mask has shape"),
    }


@pytest.mark.parametrize("case", ["aux", "hidden", "fingerprint", "empty", "nan", "width", "token", "mask"])
def test_bad_input_stops_training_before_step_one(case, qwen3_target, dataset, tmp_path):
    bad, message = _refusals(dataset)[case]
    cfg = tiny_config(qwen3_target, tmp_path, max_steps=3)
    with pytest.raises(DatasetError, match=message):
        train(cfg, bad)
    assert not (tmp_path / "store").exists()  # nothing trained, nothing published
    assert not (tmp_path / "work" / "metrics.jsonl").exists()


def test_cli_reports_a_mismatch_in_one_line(qwen3_target, dataset, tmp_path, capsys):
    info = DatasetInfo(dataset.info.aux_layer_ids, dataset.info.hidden_size, "f" * 64)
    data = write_sample_file(tmp_path / "other.safetensors", info, dataset.samples[:4])
    cfg = tiny_config(qwen3_target, tmp_path, data=str(data))
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    assert train_main(["--config", str(tmp_path / "run.yaml"), "--set", "train.max_steps=2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "different target" in err[0] and str(data) in err[0]


def test_too_small_for_one_global_batch(qwen3_target, dataset, tmp_path):
    cfg = tiny_config(qwen3_target, tmp_path, global_batch_rows=64, row_tokens=4096)
    with pytest.raises(DatasetError, match="no full step"):
        train(cfg, dataset)


def test_flex_attention_needs_cuda(qwen3_target, dataset, tmp_path):
    with pytest.raises(ConfigError, match="needs CUDA"):
        train(tiny_config(qwen3_target, tmp_path, attention="flex"), dataset)


def test_metrics_lines_and_resume_refusals(qwen3_target, dataset, tmp_path):
    """A two-step run logs loss, per-depth accuracy and throughput per step (JSONL); its checkpoint
    is not resumed by a run with another draft shape or another data plan."""
    cfg = tiny_config(qwen3_target, tmp_path, max_steps=2, val_fraction=0.2)
    result = train(cfg, dataset)
    lines = [json.loads(x) for x in (tmp_path / "work" / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2, 2]
    for key in ("loss", "position_0_acc", "position_1_acc", "position_2_acc", "tokens_per_s", "lr", "grad_norm"):
        assert key in lines[0]
    assert "val_loss" in lines[2] and "val_position_0_acc" in lines[2]
    assert result.final_uri.endswith("/final")
    assert Path(result.final_uri.removeprefix("file://"), "config.json").is_file()

    again = train(tiny_config(qwen3_target, tmp_path, max_steps=2, val_fraction=0.2), dataset)
    assert again.resumed_from == 2 and again.steps == 2  # already done: only the export is redone
    with pytest.raises(ResumeError, match="draft differs from the configured one in .*layer_config"):
        train(tiny_config(qwen3_target, tmp_path, max_steps=3, draft={"num_layers": 2}), dataset)
    with pytest.raises(ResumeError, match="another data plan"):
        train(tiny_config(qwen3_target, tmp_path, max_steps=3, val_fraction=0.2, seed=1), dataset)


def test_precision_setting_and_fused_adamw(qwen3_target, dataset, tmp_path):
    """bf16 autocast where the hardware runs it natively (auto), always when asked; AdamW uses the fused
    kernel on plain parameters; and bf16 matmuls train to the same loss as float32 within bf16 noise."""
    from peagle.train.loop import use_bf16
    from peagle.train.optim import build_optimizer
    from peagle.train.settings import TrainSettings

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert use_bf16("auto", cuda) and use_bf16("bf16", cpu) and not use_bf16("fp32", cuda)
    native = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    assert use_bf16("auto", cpu) == native
    assert build_optimizer(torch.nn.Linear(4, 4), TrainSettings()).defaults["fused"] is True

    losses = {}
    for precision in ("fp32", "bf16"):
        cfg = tiny_config(qwen3_target, tmp_path / precision, max_steps=4, precision=precision)
        losses[precision] = train(cfg, dataset).metrics["loss"]
    assert math.isfinite(losses["bf16"]) and abs(losses["bf16"] - losses["fp32"]) < 0.05 * losses["fp32"]

# -- issue #29 (folded from test_probe2_stream by h1): the step plan is made an epoch at a time

import random  # noqa: E402
import tracemalloc  # noqa: E402

from peagle.train.batches import RunPlan, plan_fingerprint  # noqa: E402


def _planning_dataset(n: int) -> ListDataset:
    """Samples of random lengths: all that planning reads (ids and token counts)."""
    rng = random.Random(5)
    return ListDataset(DatasetInfo([0, 1, 2], 8, None), [
        {"sample_id": f"s{i:03d}", "input_ids": torch.zeros(rng.randint(4, 40), dtype=torch.long)} for i in range(n)])


def test_the_plan_is_made_an_epoch_at_a_time():
    ds = _planning_dataset(64)
    idx = list(range(len(ds)))
    kw = dict(row_tokens=64, global_batch_rows=2, seed=3)
    plan = RunPlan(ds, idx, epochs=5, **kw)
    steps = plan_run(ds, idx, epochs=5, **kw)
    assert len(plan) == plan.planned_steps == len(steps) and list(plan) == steps
    assert [plan[k] for k in reversed(range(len(plan)))] == steps[::-1]  # random access, any order
    assert [plan.epoch_of(k) for k in range(len(plan))] == [st.epoch for st in steps]
    assert plan.fingerprint == plan_fingerprint(ds, steps)
    head = plan.head(7)  # train.max_steps: the fingerprint stays the full plan's
    assert len(head) == 7 and list(head) == steps[:7] and head.fingerprint == plan.fingerprint
    with pytest.raises(IndexError):
        head[7]

    def peak(epochs: int) -> int:
        tracemalloc.start()
        try:
            p = RunPlan(ds, idx, epochs=epochs, **kw)
            assert sum(1 for _ in p) == p.planned_steps > 0
            return tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

    # Memory does not grow with the epochs' steps: each further epoch costs its step count (an int), where
    # holding its 16 or so steps would cost kilobytes.
    assert peak(1000) - peak(10) < 990 * 64
