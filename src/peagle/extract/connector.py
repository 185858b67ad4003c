"""The project's KV connector for vLLM's ``extract_hidden_states`` speculative method.

vLLM's ``extract_hidden_states`` method installs a dummy draft whose single cache-only attention
layer stores, per token, the target's hidden states at the requested layer ids in its KV-cache
blocks. When a request finishes, a KV connector reads those blocks and writes one safetensors file
per request (``hidden_states`` [T, n_ids, H], ``token_ids`` [T]) guarded by a ``<file>.lock`` that
stays exclusively locked until the file is complete.

vLLM's own :class:`ExampleHiddenStatesConnector` does exactly that on CUDA, but its copy path
(``_submit_async_write``) uses CUDA streams/events and pinned memory, which do not exist on a CPU
build. :class:`PeagleHiddenStatesConnector` keeps the parent's behaviour whenever the cache lives
on an accelerator and, for a cache in host memory, gathers the request's slots with a plain
synchronous copy and hands the tensors to the parent's existing writer thread pool (same lock-file
protocol, same file layout).

Load it in vLLM with::

    kv_transfer_config={"kv_connector": "PeagleHiddenStatesConnector",
                        "kv_connector_module_path": "peagle.extract.connector",
                        "kv_role": "kv_producer",
                        "kv_connector_extra_config": {"shared_storage_path": DIR}}
"""
from __future__ import annotations

import fcntl
import os
from functools import partial

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)

__all__ = ["PeagleHiddenStatesConnector"]


class _CompletedCopy:
    """Stands in for the ``torch.cuda.Event`` the parent tracks per request.

    On the host path the copy has already happened when this object is created, so the writer
    thread's ``synchronize()`` and the scheduler-side ``query()`` poll both succeed immediately.
    """

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True


class PeagleHiddenStatesConnector(ExampleHiddenStatesConnector):
    """:class:`ExampleHiddenStatesConnector` that also works when the KV cache is in host memory."""

    def _submit_async_write(self, pending: PendingSave) -> None:
        cache = self._kv_cache
        if cache is None or cache.device.type != "cpu":
            # CUDA (or another accelerator): the parent's stream/event/pinned-memory path is right.
            super()._submit_async_write(pending)
            return
        if not self._is_tp_rank_zero:
            return  # only TP rank 0 writes, as in the parent

        block_ids = torch.tensor(pending.block_ids, dtype=torch.long)
        # Slot s of block b is b * block_size + s; the request's tokens fill its blocks in order.
        slots = (block_ids[:, None] * self._block_size + torch.arange(self._block_size)[None, :]).flatten()
        num_tokens = int(pending.token_ids.shape[0])
        # .clone(): the KV blocks are freed (and reused) as soon as we report the request done.
        hidden_states = extract_from_kv_cache(cache, slots, num_tokens).clone()
        tensors = {"hidden_states": hidden_states, "token_ids": pending.token_ids.clone()}

        if pending.req_id in self._req_futures:
            raise RuntimeError(f"hidden states of request {pending.req_id} are already being written")
        os.makedirs(os.path.dirname(pending.filename) or ".", exist_ok=True)
        # The lock was normally pre-created (LOCK_EX held) in wait_for_save before the client could
        # see the path; create it here only if that did not happen, as the parent does.
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)

        done = _CompletedCopy()
        future = self._executor.submit(self._write_tensors, tensors, done, pending.filename, lock_fd)
        self._req_copy_events[pending.req_id] = done
        self._req_futures[pending.req_id] = future
        future.add_done_callback(partial(self._on_write_done, pending.req_id))
