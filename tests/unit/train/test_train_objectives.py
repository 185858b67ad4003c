"""Loss variants (TV, JSD, depth weighting), the loss statistics the ranks sum, and the Muon optimiser: values, gradients, and a short real
training run that learns and resumes bit for bit."""
from __future__ import annotations

import math
import shutil

import pytest
import torch
from safetensors.torch import load_file

from peagle.train import TrainRunConfig, train
from peagle.train.loss import LossStats, metrics_from_stats, per_element_loss, row_loss
from peagle.train.muon import MuonAdamW, is_hidden_matrix, orthogonalize
from support.train_data import target_dataset, tiny_config


def test_tv_and_jsd_are_the_textbook_divergences():
    g = torch.Generator().manual_seed(1)
    draft, teacher = torch.randn(6, 9, generator=g), torch.randn(6, 9, generator=g) * 2
    p, q = teacher.softmax(-1), draft.softmax(-1)
    torch.testing.assert_close(per_element_loss(draft, teacher, "tv"), 0.5 * (p - q).abs().sum(-1))
    m = (p + q) / 2
    jsd = 0.5 * (p * (p / m).log()).sum(-1) + 0.5 * (q * (q / m).log()).sum(-1)
    torch.testing.assert_close(per_element_loss(draft, teacher, "jsd"), jsd)
    for kind, bound in (("tv", 1.0), ("jsd", math.log(2))):
        assert per_element_loss(teacher, teacher, kind).abs().max() < 1e-6  # zero at the teacher
        assert (per_element_loss(draft, teacher, kind) <= bound + 1e-6).all()
        x = draft.clone().requires_grad_()
        per_element_loss(x, teacher, kind).sum().backward()
        assert x.grad.abs().sum() > 0
    # JSD is symmetric; one-hot teachers (p = 0 almost everywhere) stay finite
    torch.testing.assert_close(per_element_loss(draft, teacher, "jsd"), per_element_loss(teacher, draft, "jsd"))
    hard = torch.full((2, 9), -1e4)
    hard[:, 3] = 0.0
    assert torch.isfinite(per_element_loss(draft[:2], hard, "jsd")).all()


def test_depth_weight_scales_the_objective_not_the_logged_loss():
    g = torch.Generator().manual_seed(2)
    draft, teacher = torch.randn(5, 7, generator=g), torch.randn(5, 7, generator=g)
    depths = torch.tensor([0, 1, 1, 2, 3])
    ell = per_element_loss(draft, teacher, "kl")
    weighted = row_loss(draft, teacher, depths, 4, "kl", depth_weight=0.5)
    torch.testing.assert_close(weighted.loss_sum, (ell * 0.5 ** depths.float()).sum())
    plain = row_loss(draft, teacher, depths, 4, "kl")
    assert metrics_from_stats(weighted.stats)["loss"] == metrics_from_stats(plain.stats)["loss"]


def test_loss_stats_are_one_vector_in_a_fixed_order():
    g = torch.Generator().manual_seed(0)
    draft, teacher = torch.randn(6, 9, generator=g), torch.randn(6, 9, generator=g)
    depths = torch.tensor([0, 0, 1, 1, 2, 5])  # deeper than num_depths - 1: counted at the last depth
    a = row_loss(draft[:3], teacher[:3], depths[:3], 3, "kl").stats
    b = row_loss(draft[3:], teacher[3:], depths[3:], 3, "kl").stats
    total = a + b
    vector = total.to_tensor()
    assert vector.dtype == torch.float64 and vector.shape == (2 + 2 * 3,)
    # loss sum, elements, correct per depth, elements per depth: the order the ranks sum in
    assert vector[1].item() == 6 and vector[5:].tolist() == [2.0, 2.0, 2.0]
    assert vector.equal(a.to_tensor() + b.to_tensor())
    back = LossStats.from_tensor(vector)
    assert back.elements.item() == 6 and back.counted.tolist() == [2.0, 2.0, 2.0]
    assert metrics_from_stats(back, prefix="val_") == metrics_from_stats(total, prefix="val_")
    zeros = LossStats.zeros(3)
    assert zeros.to_tensor().equal(torch.zeros(8, dtype=torch.float64))
    assert math.isnan(metrics_from_stats(zeros)["position_0_acc"]) and metrics_from_stats(zeros)["loss"] == 0


def test_orthogonalize_flattens_the_spectrum():
    g = torch.Generator().manual_seed(3)
    for shape in ((32, 64), (96, 24)):
        a = torch.randn(*shape, generator=g) @ torch.diag(torch.logspace(0, 3, shape[1]))  # condition 1000
        out = orthogonalize(a)
        s = torch.linalg.svdvals(out.float())
        assert out.shape == a.shape and s.max() < 1.5 and s.max() / s.min() < 5  # condition 1000 -> < 5
        # the same iteration as torch.optim.Muon's (its private helper; bf16 both)
        from torch.optim._muon import _zeropower_via_newtonschulz

        ref = _zeropower_via_newtonschulz(a, (3.4445, -4.7750, 2.0315), 5, 1e-7).float()
        assert (out.float() - ref).abs().max() < 0.05


def test_muon_updates_hidden_matrices_and_adamw_the_rest(qwen3_target, tmp_path):
    from peagle.model import init_draft

    cfg = tiny_config(qwen3_target, tmp_path, optimizer="muon")
    model = init_draft(str(qwen3_target), cfg.draft, None)
    opt = MuonAdamW(model.named_parameters(), lr=1e-3, weight_decay=0.0, betas=(0.9, 0.95))
    kinds = {g["kind"]: g["params"] for g in opt.param_groups}
    names = {id(p): n for n, p in model.named_parameters()}
    assert all(p.ndim == 2 and "embed_tokens" not in names[id(p)] for p in kinds["muon"])
    assert any("embed_tokens" in names[id(p)] for p in kinds["adamw"])
    assert not any("lm_head" in names[id(p)] for group in kinds.values() for p in group)  # frozen
    assert is_hidden_matrix("layers.0.self_attn.q_proj.weight", torch.zeros(4, 4))
    with pytest.raises(ValueError, match="distributed=ddp"):
        TrainRunConfig.model_validate({"train": {"optimizer": "muon", "distributed": "fsdp"}})


def test_muon_and_the_new_losses_train_and_resume_bitwise(qwen3_target, tmp_path):
    ds = target_dataset(qwen3_target, 24, seed=4)

    def run(name: str, **kw):
        cfg = tiny_config(qwen3_target, tmp_path / name, optimizer="muon", loss="jsd", depth_weight=0.8,
                          epochs=2, row_tokens=96, **kw)  # 10 steps: 5 an epoch
        return train(cfg, ds)

    full = run("full", checkpoint_every=6)
    assert full.metrics["loss"] < 0.9 * first_loss(tmp_path / "full")
    # a run killed after its step-6 checkpoint (in the second epoch): only that checkpoint is left; run it again
    step6 = tmp_path / "full" / "store" / "checkpoints" / "step-000000006"
    shutil.copytree(step6, tmp_path / "split" / "store" / "checkpoints" / step6.name)
    resumed = run("split", checkpoint_every=6)
    assert resumed.resumed_from == 6 and resumed.steps == full.steps
    a = load_file(str(tmp_path / "full" / "store" / "final" / "model.safetensors"))
    b = load_file(str(tmp_path / "split" / "store" / "final" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    tv = tiny_config(qwen3_target, tmp_path / "tv", loss="tv", max_steps=2, row_tokens=96)
    assert math.isfinite(train(tv, ds).metrics["loss"])


def first_loss(run_dir) -> float:
    import json

    return json.loads((run_dir / "work" / "metrics.jsonl").read_text().splitlines()[0])["loss"]
