"""The extraction connector's dispatch (a CUDA-only branch, exercised in part on CPU): a KV cache on an
accelerator goes to vLLM's own stream/event path, a host cache never does. The host path itself is
run by the real-vLLM extraction tests (tests/integration/vllm/test_extract_vllm.py); the CUDA path by bench/gpu_check.py."""
from __future__ import annotations

import pytest
import torch

connector = pytest.importorskip("peagle.extract.connector")


class _Reached(Exception):
    pass


def _bare(cache: torch.Tensor | None):
    c = object.__new__(connector.PeagleHiddenStatesConnector)  # no engine: only the dispatch is under test
    c._kv_cache = cache
    c._is_tp_rank_zero = False  # the host path returns right after dispatch on a non-zero TP rank
    return c


def test_accelerator_cache_goes_to_the_parent_path(monkeypatch):
    def parent(self, pending):
        raise _Reached(pending)

    monkeypatch.setattr(connector.ExampleHiddenStatesConnector, "_submit_async_write", parent)
    for cache in (torch.empty(2, 2, device="meta"), None):  # 'meta' stands in for a CUDA device here
        with pytest.raises(_Reached):
            _bare(cache)._submit_async_write("pending")


def test_host_cache_never_takes_the_cuda_path(monkeypatch):
    def parent(self, pending):
        raise AssertionError("the CUDA stream/event path was taken for a host cache")

    monkeypatch.setattr(connector.ExampleHiddenStatesConnector, "_submit_async_write", parent)
    assert _bare(torch.zeros(2, 2))._submit_async_write("pending") is None
