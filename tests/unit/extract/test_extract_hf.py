"""Extraction building blocks without a vLLM engine: settings and layer ids, input rows, the
transformers backend's layer semantics and padding, and the reader side of vLLM's request files."""
from __future__ import annotations

import fcntl
import os
import random
import threading
import time

import pytest
import torch
from safetensors.torch import save_file

from peagle.extract import ExtractError, ExtractSettings, as_extract_row, resolve_layer_ids
from peagle.extract.hf_backend import HfHiddenStatesExtractor
from peagle.extract.rows import ExtractRow
from peagle.extract.vllm_backend import read_request_file
from peagle.model.target import TargetError


def _rows(n: int, seed: int = 0, vocab: int = 480, max_len: int = 40) -> list[ExtractRow]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        t = rng.randint(2, max_len)
        out.append(ExtractRow(f"r{i}", tuple(rng.randrange(vocab) for _ in range(t)), tuple([0, 1] * t)[:t]))
    return out


# ---------------------------------------------------------------------------------------------
# settings and layer ids


def test_default_layer_ids_are_2_n_half_n_minus_3_plus_last():
    ids = resolve_layer_ids(None, 8)
    assert ids.aux == (2, 4, 5) and ids.last == 8 and ids.all == [2, 4, 5, 8]
    assert resolve_layer_ids(None, 36).all == [2, 18, 33, 36]
    assert resolve_layer_ids([1, 3, 6], 8).all == [1, 3, 6, 8]


def test_layer_id_settings_are_validated():
    with pytest.raises(ValueError, match="exactly 3"):
        ExtractSettings(aux_layer_ids=[1, 2])
    with pytest.raises(ValueError, match="ascending"):
        ExtractSettings(aux_layer_ids=[4, 2, 5])
    with pytest.raises(TargetError, match="outside"):
        resolve_layer_ids([2, 4, 8], 8)  # 8 is the last layer itself, not an aux id
    with pytest.raises(ValueError, match="unknown key|extra"):
        ExtractSettings.model_validate({"bakend": "hf"})


# ---------------------------------------------------------------------------------------------
# input rows


def test_rows_are_normalised_from_mappings_and_objects():
    import numpy as np

    class Obj:
        sample_id, input_ids, loss_mask = 7, np.array([1, 2, 3], dtype=np.int32), np.array([0, 1, 1], dtype=np.int8)

    r = as_extract_row(Obj(), vocab_size=10)
    assert r == ExtractRow("7", (1, 2, 3), (0, 1, 1))
    assert as_extract_row({"sample_id": "a", "input_ids": [4], "loss_mask": [1]}).input_ids == (4,)


@pytest.mark.parametrize("row, match", [
    ({"sample_id": "bad-len", "input_ids": [1, 2], "loss_mask": [1]}, "'bad-len'.*2 input_ids but 1"),
    ({"sample_id": "oov", "input_ids": [1, 99], "loss_mask": [1, 1]}, "'oov'.*token id 99"),
    ({"sample_id": "empty", "input_ids": [], "loss_mask": []}, "'empty'.*empty"),
    ({"sample_id": "mask", "input_ids": [1], "loss_mask": [2]}, "'mask'.*only 0 and 1"),
    ({"input_ids": [1], "loss_mask": [1]}, "without a sample_id"),
])
def test_bad_rows_are_rejected_naming_the_sample(row, match):
    with pytest.raises(ExtractError, match=match):
        as_extract_row(row, vocab_size=50)


# ---------------------------------------------------------------------------------------------
# transformers backend semantics


def test_hf_backend_layer_semantics(qwen3_target):
    """aux id k = output_hidden_states[k]; last = pre-norm (its RMSNorm is output_hidden_states[n])."""
    from transformers import AutoModelForCausalLM

    rows = _rows(2, seed=3)
    ex = HfHiddenStatesExtractor(qwen3_target, resolve_layer_ids(None, 8), "float32", batch_size=1, device="cpu")
    got = ex.extract(rows)
    model = AutoModelForCausalLM.from_pretrained(str(qwen3_target), dtype=torch.float32).eval()
    for row, s in zip(rows, got):
        with torch.no_grad():
            hs = model(input_ids=torch.tensor([row.input_ids]), output_hidden_states=True).hidden_states
        for j, k in enumerate((2, 4, 5)):
            torch.testing.assert_close(s.aux[:, j], hs[k][0], rtol=0, atol=1e-5)
        # the pre-norm value is NOT transformers' hidden_states[n]; the final norm of it is
        assert (s.last - hs[8][0]).abs().max() > 1.0
        torch.testing.assert_close(model.model.norm(s.last), hs[8][0], rtol=1e-5, atol=1e-5)


def test_hf_backend_padding_does_not_change_results(qwen3_target):
    rows = _rows(7, seed=4)
    ids = resolve_layer_ids(None, 8)
    batched = HfHiddenStatesExtractor(qwen3_target, ids, "float32", batch_size=4, device="cpu").extract(rows)
    single = HfHiddenStatesExtractor(qwen3_target, ids, "float32", batch_size=1, device="cpu").extract(rows)
    assert [s.row.sample_id for s in batched] == [r.sample_id for r in rows]  # input order kept
    for a, b in zip(batched, single):
        assert a.aux.shape == (a.row.num_tokens, 3, 256)
        torch.testing.assert_close(a.aux, b.aux, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(a.last, b.last, rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------------------------------------
# vLLM request files (the connector's output), read without an engine


def _write_request_file(path, token_ids, hidden):
    save_file({"hidden_states": hidden, "token_ids": torch.tensor(token_ids)}, path)


def test_request_file_waits_for_lock_then_splits_and_cleans_up(tmp_path):
    row = ExtractRow("sample-A", (5, 6, 7), (0, 1, 1))
    hidden = torch.randn(3, 4, 16).to(torch.bfloat16)
    path = str(tmp_path / "req.safetensors")
    lock_fd = os.open(path + ".lock", os.O_CREAT | os.O_WRONLY, 0o644)
    fcntl.flock(lock_fd, fcntl.LOCK_EX)  # as the connector does before the path is handed out

    def writer():
        time.sleep(0.3)
        _write_request_file(path, list(row.input_ids), hidden)
        os.close(lock_fd)  # releases LOCK_EX

    t = threading.Thread(target=writer)
    t.start()
    start = time.monotonic()
    s = read_request_file(path, row)  # must block until the writer is done
    t.join()
    assert time.monotonic() - start >= 0.25
    assert torch.equal(s.aux, hidden[:, :3]) and torch.equal(s.last, hidden[:, 3])
    assert not os.path.exists(path) and not os.path.exists(path + ".lock")


def test_request_file_token_mismatch_names_the_sample(tmp_path):
    path = str(tmp_path / "req.safetensors")
    _write_request_file(path, [5, 6, 8], torch.zeros(3, 4, 16))
    with pytest.raises(ExtractError, match=r"sample 'conv-17'.*differ.*position 2"):
        read_request_file(path, ExtractRow("conv-17", (5, 6, 7), (1, 1, 1)))


def test_engine_process_failure_is_reported_with_its_log_tail():
    """The parent/child plumbing of the vLLM backend, failing before any engine starts."""
    from peagle.extract.vllm_backend import run_engine_job

    job = {"settings": {"backend": "vllm", "no_such_setting": 1}}
    with pytest.raises(ExtractError, match=r"(?s)engine failed \(exit 1\).*no_such_setting"):
        run_engine_job(job, ExtractSettings())
