"""The GPU path in one run: every CUDA-only code path of peagle, checked and timed, one table.

    python bench/gpu_check.py [--work runs/gpu-check] [--only training,throughput]   # on a GPU (< 8 min, H200)
    python bench/gpu_check.py --dry-run                                                # on CPU (< 2 min)

Sections (each a function; a failing one records FAIL with its error and the run goes on; the exit
status is 1 if any check failed):

environment   torch / CUDA / driver / vLLM versions, the GPU and its bf16 peak (peagle.train.flops).
flex          flex-attention BlockMask vs dense SDPA mask on the same rows: loss and every gradient,
              forward and backward, fp32 and bf16 autocast, full and sliding layers.
distributed   a 1-process NCCL group, the trainer's DDP wrapping, all-reduce, gradient sync and a few
              bf16-autocast steps through the draft on flex attention.
extraction    vLLM CUDA extraction (peagle.extract.connector on a cache in GPU memory) vs the
              transformers reference on the embedded SmolLM2 target: relative error per layer, tokens/s.
serving       a short draft trained by peagle.train.train on those hidden states (K = 4), served by
              vLLM (long form); greedy outputs vs the target alone, spec-decode counters read back.
speed         that draft's speed per load: the evaluation's sweep (target alone, K = 1, 2, 4 at 1..64
              requests in flight; tokens/s ratio with intervals, TPOT, TTFT) and the schedule chosen from it,
              served by vLLM with num_speculative_tokens_per_batch_size.
throughput    trainer step on a draft shaped like a Llama-3.1-8B draft (hidden 4096, synthetic hidden
              states, 2048-token rows): tokens/s, step split (data/forward/backward/optimizer), model
              TFLOP/s, MFU (SpecForge trains such drafts at about 44 %), peak memory.

``--dry-run`` runs what needs no CUDA on CPU (small shapes, gloo, dense attention, fp32); the vLLM
engines are not started (their inputs are still built) and flex attention runs forward only, the
rest of each CUDA check is a 'skipped: needs CUDA' row.

CUDA-only branches this script reaches (``grep -rn 'cuda\\|flex_attention\\|nccl\\|is_available()' src``):

* src/peagle/train/loop.py: ``attention=auto`` -> flex on CUDA; ``use_bf16`` (bf16 autocast on CUDA);
  rows' hidden states in bf16 on CUDA; MFU from ``device_peak_flops`` (serving: the trained draft;
  flex, distributed and throughput: the same pieces one by one).
* src/peagle/model/layers.py ``Attention.forward``: the BlockMask branch, ``torch.compile(flex_attention)``
  (flex, distributed, throughput, serving).
* src/peagle/model/attention_mask.py ``block_mask`` on a CUDA device (flex, distributed, throughput).
* src/peagle/train/distributed.py: CUDA device selection; NCCL process group with ``device_id``
  (the same call, made here for a group of one); DDP ``device_ids``; ``all_reduce_sum`` moving host
  tensors to the device for NCCL (distributed).
* src/peagle/train/optim.py: fused AdamW on CUDA parameters (distributed, throughput, serving).
* src/peagle/train/checkpoint.py: CUDA RNG state saved with every checkpoint (serving; restoring it
  on resume is *not* reached).
* src/peagle/train/flops.py ``device_peak_flops`` (environment, throughput, serving).
* src/peagle/extract/hf_backend.py ``device="auto"`` -> CUDA (extraction).
* src/peagle/extract/connector.py: the parent's CUDA stream / event / pinned-memory copy for a KV cache
  on the GPU (extraction); its dispatch (accelerator cache -> the parent's path) is also tested on
  CPU in tests/unit/extract/test_connector_dispatch.py.
* src/peagle/evaluate/vllm_job.py: eagle3 + ``parallel_drafting`` on CUDA, ``_device()`` naming the GPU (serving).

Not reached: CUDA graphs in the evaluation stage (``evaluate.engine.enforce_eager`` defaults to
compiled on CUDA; a job run directly is eager), resume on CUDA, FSDP2 over NCCL with more than one
rank, NCCL across GPUs/nodes, and the GPU container images themselves.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.metadata
import inspect
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

from harness import format_table, machine_facts

SECTIONS = ("environment", "flex", "distributed", "extraction", "serving", "speed", "throughput")
SKIP_CUDA = "skipped: needs CUDA"
SPECFORGE_MFU = 0.44  # SpecForge's reported MFU for draft training: the anchor, not a pass mark


# ----------------------------------------------------------------------------------------------
# The table


@dataclass
class Check:
    section: str
    name: str
    status: str  # PASS, FAIL, SKIP or INFO
    detail: str = ""


@dataclass
class Context:
    dry_run: bool
    work: Path
    device: torch.device
    checks: list[Check] = field(default_factory=list)
    section: str = ""
    target: Path | None = None  # the prepared target: SmolLM2 unless --target (extraction, serving)
    dataset: Path | None = None  # hidden states of the target (extraction -> serving)
    draft: Path | None = None  # the draft the serving section trained (serving -> speed)

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def add(self, name: str, status: str, detail: str = "") -> None:
        self.checks.append(Check(self.section, name, status, detail))

    def expect(self, name: str, ok: bool, detail: str) -> None:
        self.add(name, "PASS" if ok else "FAIL", detail)

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)


def print_table(checks: list[Check], wall_s: float) -> None:
    print(format_table(["section", "check", "status", "detail"], [[c.section, c.name, c.status, c.detail]
                                                                  for c in checks]))
    failed = sum(c.status == "FAIL" for c in checks)
    print(f"\n{len(checks)} checks, {failed} failed, wall {wall_s:.1f} s")


# ----------------------------------------------------------------------------------------------
# Shared inputs


def synthetic_spec(*, hidden: int, heads: int, kv_heads: int, head_dim: int, intermediate: int, vocab: int,
                   draft_vocab: int, num_layers: int, num_depths: int, arch: str = "llama",
                   sliding_window: int | None = None, full_attention_layers: list[int] | None = None):
    """A DraftSpec for a target that exists only as its shape (no weights needed for training speed)."""
    from transformers import LlamaConfig

    from peagle.model.spec import DraftSpec, build_layer_config

    tc = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=32,
                     num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                     max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0)
    lc = build_layer_config(tc, arch, num_layers, sliding_window, full_attention_layers or [])
    return DraftSpec(arch=arch, layer_config=lc, draft_vocab_size=draft_vocab, mask_token_id=1,
                     aux_layer_ids=[2, 16, 29], norm_before_residual=False, num_depths=num_depths,
                     verifier_name_or_path="synthetic", verifier_architectures=["LlamaForCausalLM"])


def synthetic_samples(spec, lengths: list[int], seed: int, prompt: int = 16) -> list[dict]:
    """Samples shaped like an extraction output: random tokens and hidden states, a prompt then an answer."""
    g = torch.Generator().manual_seed(seed)
    h, out = spec.hidden_size, []
    for i, n in enumerate(lengths):
        mask = torch.ones(n, dtype=torch.long)
        mask[:min(prompt, n - 1)] = 0
        out.append({"sample_id": f"synthetic-{seed}-{i}", "input_ids": torch.randint(0, spec.vocab_size, (n,), generator=g),
                    "loss_mask": mask, "aux_hidden": torch.randn(n, spec.num_aux * h, generator=g),
                    "last_hidden": torch.randn(n, h, generator=g)})
    return out


def make_row(spec, samples: list[dict], seed: int, *, dense: bool, hidden_dtype=torch.float32, max_anchors=512):
    """One packed training row of ``samples``, prepared exactly as the trainer's RowMaker does."""
    from peagle.train.batches import prepare_row

    return prepare_row([(s, s["input_ids"].numel()) for s in samples], num_depths=spec.num_depths,
                       generator=torch.Generator().manual_seed(seed), cod_ratio=0.7, cod_ratio_min=0.2,
                       max_anchors=max_anchors, pad_to_multiple=64, hidden_dtype=hidden_dtype,
                       dense_layer_types=spec.layer_types if dense else None, sliding_window=spec.sliding_window)


def build_model(spec, device: torch.device, seed: int = 0):
    """The draft and a teacher (random target norm + the draft's frozen lm head), on ``device``."""
    from peagle.model.draft import PEagleDraftModel
    from peagle.model.teacher import Teacher

    torch.manual_seed(seed)
    model = PEagleDraftModel(spec)
    model.reset_parameters(seed)
    with torch.no_grad():  # init_draft copies these from the target; any values do for the checks
        model.embed_tokens.weight.normal_(0, 0.02)
        model.lm_head.weight.normal_(0, 0.02)
    teacher = Teacher(torch.ones(spec.hidden_size), model.lm_head.weight, 1e-5)
    return model.to(device), teacher.to(device)


def masks_for(spec, row, attention: str):
    """What the loop's ``forward_row`` passes as the attention mask (dense tensors or flex BlockMasks)."""
    from peagle.model.attention_mask import layer_masks

    if attention == "dense":
        return row.dense_masks
    return layer_masks(spec.layer_types, row.anchors, row.depths[0], row.document_ids, spec.sliding_window, "flex")


def row_forward(model, teacher, spec, row, attention: str, bf16: bool):
    """The loop's forward_row: masks, autocast, draft forward, the row loss (a RowLoss)."""
    from peagle.train.loss import row_loss

    masks = masks_for(spec, row, attention)
    with torch.autocast(row.input_ids.device.type, dtype=torch.bfloat16, enabled=bf16):
        out = model(row.input_ids, row.aux_hidden, row.position_ids, row.depths, masks)
    return row_loss(out.logits[0, row.supervised], teacher(row.teacher_hidden), row.supervised_depths,
                    spec.num_depths, "kl")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64."""
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


# ----------------------------------------------------------------------------------------------
# Sections


def environment(ctx: Context) -> None:
    from peagle.train.flops import peak_bf16_tflops

    facts = machine_facts()
    for name in ("cpu", "torch", "vllm", "transformers"):
        ctx.add(name, "INFO", facts[name])
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
        ctx.add("triton", "INFO", importlib.metadata.version("triton"))
    if not ctx.cuda:
        ctx.add("cuda", "SKIP" if ctx.dry_run else "FAIL",
                "no CUDA device (dry run on CPU)" if ctx.dry_run else "torch.cuda.is_available() is False")
        return
    name = torch.cuda.get_device_name(ctx.device)
    driver = "unknown"
    with contextlib.suppress(Exception):
        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=20).stdout.strip().splitlines()[0]
    ctx.add("gpu", "INFO", facts["gpu"])
    ctx.add("driver", "INFO", f"{driver}; cuDNN {torch.backends.cudnn.version()}; NCCL "
                              f"{'.'.join(map(str, torch.cuda.nccl.version()))}")
    peak = peak_bf16_tflops(name)
    ctx.add("bf16 peak", "INFO" if peak else "FAIL",
            f"{peak:.0f} TFLOP/s dense" if peak else f"{name!r} is not in peagle.train.flops.PEAK_BF16_TFLOPS: no MFU")


def flex(ctx: Context) -> None:
    """Flex BlockMask vs dense SDPA mask: same model, same rows, loss and gradients."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    import torch.nn.functional as F

    from peagle.model.attention_mask import dense_mask, element_mask_mod

    # Two layers: a sliding one and a full one, so both mask kinds go through both paths.
    spec = synthetic_spec(hidden=256, heads=4, kv_heads=2, head_dim=64, intermediate=512, vocab=1024,
                          draft_vocab=512, num_layers=2, num_depths=5, arch="qwen3", sliding_window=96,
                          full_attention_layers=[1])
    samples = synthetic_samples(spec, [150, 90, 170], seed=1)  # 3 documents + padding, > 3 flex blocks
    row = make_row(spec, samples, seed=2, dense=True)
    s = row.anchors.numel()
    anchors, depths, docs = row.anchors, row.depths[0], row.document_ids

    # The predicate flex evaluates equals the dense mask, pair by pair (runs everywhere).
    for window in (None, spec.sliding_window):
        mod = element_mask_mod(anchors, depths, docs, window)
        idx = torch.arange(s)
        grid = mod(None, None, idx[:, None], idx[None, :])
        ctx.expect(f"mask_mod == dense mask ({'window ' + str(window) if window else 'full'})",
                   torch.equal(grid, dense_mask(anchors, depths, docs, window)), f"S = {s} elements")

    # flex forward on CPU (eager: no backward there) vs SDPA with the dense mask.
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 4, s, 32, generator=g) for _ in range(3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        bm = create_block_mask(element_mask_mod(anchors, depths, docs), B=None, H=None, Q_LEN=s, KV_LEN=s,
                               device="cpu")
        with torch.no_grad():
            got = flex_attention(q, k, v, block_mask=bm)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=dense_mask(anchors, depths, docs))
    err = rel(got, want)
    ctx.expect("flex forward (CPU, eager) vs SDPA", err < 1e-5, f"rel err {err:.1e}")
    if not ctx.cuda:
        ctx.add("draft loss + grads, flex vs dense", "SKIP", SKIP_CUDA + " (flex attention has no CPU backward)")
        return

    model, teacher = build_model(spec, ctx.device)
    row = row.to(ctx.device)
    for bf16, tol_loss, tol_grad in ((False, 1e-4, 1e-3), (True, 2e-2, 5e-2)):
        results = {}
        for attention in ("dense", "flex"):
            model.zero_grad(set_to_none=True)
            rl = row_forward(model, teacher, spec, row, attention, bf16)
            rl.loss_sum.backward()
            results[attention] = (rl.loss_sum.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()
                                                        if p.grad is not None})
        (ld, gd), (lf, gf) = results["dense"], results["flex"]
        loss_err = rel(lf, ld)
        grad_errs = {n: rel(gf[n], gd[n]) for n in gd}
        worst = max(grad_errs, key=grad_errs.get)
        label = "bf16 autocast" if bf16 else "fp32"
        ctx.expect(f"loss flex vs dense ({label})", loss_err < tol_loss, f"rel err {loss_err:.1e} (tol {tol_loss:g})")
        ctx.expect(f"grads flex vs dense ({label})", set(gf) == set(gd) and grad_errs[worst] < tol_grad,
                   f"{len(gd)} tensors, worst {worst} rel err {grad_errs[worst]:.1e} (tol {tol_grad:g})")


def distributed(ctx: Context) -> None:
    """A process group of one (NCCL on CUDA, gloo on CPU) through the trainer's distributed helpers."""
    import torch.distributed as dist

    from peagle.train.distributed import DistEnv, all_reduce_sum, gradient_sync, local_tensor, wrap_model
    from peagle.train.optim import build_optimizer
    from peagle.train.settings import TrainSettings

    class GroupOfOne(DistEnv):
        # DistEnv treats world size 1 as "no process group"; here the group exists on purpose, so the
        # trainer's DDP wrapping and collectives run over the backend even with one GPU.
        @property
        def distributed(self) -> bool:
            return True

    backend = "nccl" if ctx.cuda else "gloo"
    # A file store of its own: a free TCP port picked here can be taken by another group before the store binds
    # it (a test run had one process join another's store and wait there).
    store = ctx.work / "process-group-store"
    store.unlink(missing_ok=True)
    # The same call init_distributed makes under torchrun (backend, device_id), for a group of one.
    dist.init_process_group(backend, init_method=f"file://{store}", rank=0, world_size=1,
                            timeout=datetime.timedelta(minutes=5), device_id=ctx.device if ctx.cuda else None)
    try:
        env = GroupOfOne(0, 1, 0, ctx.device)
        t = all_reduce_sum(torch.tensor([1.0, 2.0], dtype=torch.float64), env)  # host tensor: moved for NCCL
        ctx.expect(f"{backend} all_reduce (host tensor)", t.tolist() == [1.0, 2.0], f"backend {dist.get_backend()}")
        spec = synthetic_spec(hidden=512 if ctx.cuda else 128, heads=8 if ctx.cuda else 4, kv_heads=2, head_dim=64
                              if ctx.cuda else 32, intermediate=1024 if ctx.cuda else 256, vocab=4096, draft_vocab=2048,
                              num_layers=1, num_depths=4)
        model, teacher = build_model(spec, ctx.device)
        wrapped = wrap_model(model, "ddp", env)
        ctx.expect("trainer wraps in DDP", type(wrapped).__name__ == "DistributedDataParallel", type(wrapped).__name__)
        opt = build_optimizer(wrapped, TrainSettings(lr=3e-3))
        attention, bf16 = ("flex", True) if ctx.cuda else ("dense", False)
        n = 1024 if ctx.cuda else 128
        rows = [make_row(spec, synthetic_samples(spec, [n // 2, n // 2], seed=10 + i), seed=i,
                         dense=attention == "dense", hidden_dtype=torch.bfloat16 if ctx.cuda else torch.float32)
                for i in range(2)]
        losses, t0 = [], time.perf_counter()
        for _ in range(6):
            total = 0.0
            for i, row in enumerate(rows):  # gradient accumulation, as in the loop
                with gradient_sync(wrapped, enabled=i == len(rows) - 1):
                    rl = row_forward(wrapped, teacher, spec, row.to(ctx.device), attention, bf16)
                    scale = 1.0 / float(sum(r.supervised.numel() for r in rows))
                    (rl.loss_sum * scale).backward()
                total += float(rl.loss_sum.detach()) * scale
            local_tensor(torch.nn.utils.clip_grad_norm_(wrapped.parameters(), 1.0))
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(total)
        ctx.sync()
        wall = time.perf_counter() - t0
        finite = all(x == x and abs(x) != float("inf") for x in losses)
        ctx.expect(f"6 steps, {attention} attention, {'bf16 autocast' if bf16 else 'fp32'}",
                   finite and losses[-1] < losses[0],
                   f"loss {losses[0]:.3f} -> {losses[-1]:.3f}, {wall:.1f} s (first step compiles)")
    finally:
        dist.destroy_process_group()
    if not ctx.cuda:
        ctx.add("NCCL backend", "SKIP", SKIP_CUDA + " (gloo ran instead)")


def _prepare_target(ctx: Context) -> Path:
    from peagle.model import prepare_target
    from peagle.model.target import MANIFEST

    if ctx.target is not None:
        return ctx.target
    target = ctx.work / "smollm2"
    if not (target / MANIFEST).exists():
        prepare_target("smollm2", target, "bfloat16")
    ctx.target = target
    return target


def _text_rows(target: Path, n: int, length: int) -> list[dict]:
    """``n`` rows of ``length`` tokens of Python source (stdlib), half prompt, half supervised."""
    import argparse as _a
    import collections as _c
    import json as _j
    import textwrap as _t

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(target))
    ids = tok("\n".join(inspect.getsource(m) for m in (_a, _c, _j, _t)))["input_ids"]
    stride = max(1, (len(ids) - length) // max(1, n))
    rows = []
    for i in range(n):
        chunk = ids[i * stride:i * stride + length]
        rows.append({"sample_id": f"src-{i:04d}", "input_ids": chunk,
                     "loss_mask": [0] * (len(chunk) // 2) + [1] * (len(chunk) - len(chunk) // 2)})
    return rows


class _ProgressLog(logging.Handler):
    """Collects the vLLM extraction engine's per-shard progress (tokens, seconds without engine start)."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.shards: list[dict] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith("extracted "):
            self.shards.append(json.loads(record.getMessage()[len("extracted "):]))


def extraction(ctx: Context) -> None:
    from peagle.extract import ExtractSettings, HiddenStatesDataset, resolve_layer_ids, run_extract
    from peagle.extract.hf_backend import HfHiddenStatesExtractor
    from peagle.extract.rows import as_extract_row
    from peagle.model import inspect_target

    t0 = time.perf_counter()
    target = _prepare_target(ctx)
    info = inspect_target(target)
    print(f"[gpu_check] target prepared in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    layer_ids = resolve_layer_ids(None, info.num_layers)
    n, length = (64, 512) if ctx.cuda else (4, 24)
    settings = ExtractSettings(backend="vllm", samples_per_shard=16,
                               engine={"max_num_seqs": 16, "gpu_memory_utilization": 0.3, "timeout_s": 300})
    rows = _text_rows(target, n, length)
    tokens = sum(len(r["input_ids"]) for r in rows)
    if not ctx.cuda:
        # The serving section's draft still needs training data: the reference backend writes it
        # (float32: bf16 matmuls are emulated, slowly, on most CPUs).
        ctx.dataset = ctx.work / "hs-hf"
        t0 = time.perf_counter()
        run_extract(rows, target, ctx.dataset, ExtractSettings(backend="hf", samples_per_shard=16, hf_device="cpu",
                                                               dtype="float32"))
        ctx.add("transformers backend (run_extract)", "PASS", f"{n} rows, {tokens} tokens, "
                f"{time.perf_counter() - t0:.1f} s incl. model load; dataset for serving")
        ctx.add("vLLM extraction (connector CUDA path)", "SKIP", SKIP_CUDA + f"; rows and {settings.backend} "
                f"settings built (layer ids {layer_ids.all})")
        return
    ctx.add("inputs", "INFO", f"{target.name} ({info.num_layers} layers, hidden {info.hidden_size}), {n} rows, "
                              f"{tokens} tokens, layer ids {layer_ids.all}")

    # Reference: transformers, in this process (CUDA when there is one).
    hf = HfHiddenStatesExtractor(target, layer_ids, "bfloat16", batch_size=16, device="auto")
    ext_rows = [as_extract_row(r) for r in rows]
    hf.extract(ext_rows[:2])  # warm-up (kernels, allocator)
    ctx.sync()
    t0 = time.perf_counter()
    ref = hf.extract(ext_rows)
    ctx.sync()
    hf_s = time.perf_counter() - t0
    hf.close()
    ctx.add("transformers tokens/s", "INFO", f"{tokens / hf_s:,.0f} tok/s on {hf.device} ({hf_s:.2f} s)")

    progress = _ProgressLog()
    logger = logging.getLogger("peagle.extract.vllm_backend")
    logger.addHandler(progress)
    logger.setLevel(logging.INFO)
    try:
        t0 = time.perf_counter()
        out = ctx.work / "hs-vllm"
        run_extract(rows, target, out, settings)
        wall = time.perf_counter() - t0
    finally:
        logger.removeHandler(progress)
    ctx.dataset = out
    engine_s = sum(p["seconds"] for p in progress.shards) or wall
    ctx.add("vLLM tokens/s", "INFO", f"{tokens / engine_s:,.0f} tok/s in shards ({engine_s:.2f} s; wall incl. "
                                     f"engine start {wall:.0f} s); {tokens / engine_s / (tokens / hf_s):.1f}x transformers")
    ds = HiddenStatesDataset(out, expect_layer_ids=layer_ids.all, out_dtype=torch.float32)
    got = {s.sample_id: s for s in ds}
    names = [f"aux {k}" for k in layer_ids.aux] + [f"last {layer_ids.last} (pre-norm)"]
    diff, norm = torch.zeros(4, dtype=torch.float64), torch.zeros(4, dtype=torch.float64)
    for r in ref:
        v = got[r.row.sample_id]
        ctx_ids = v.input_ids.tolist() == list(r.row.input_ids)
        if not ctx_ids:
            raise AssertionError(f"sample {r.row.sample_id}: token ids differ between vLLM's shard and the input")
        V = torch.cat([v.aux_hidden.reshape(-1, 3, info.hidden_size), v.last_hidden[:, None]], 1).double()
        H = torch.cat([r.aux.double(), r.last.double()[:, None]], 1)
        diff += (V - H).pow(2).sum(dim=(0, 2))
        norm += H.pow(2).sum(dim=(0, 2))
    errs = (diff / norm).sqrt().tolist()
    for name, e in zip(names, errs):
        # bf16 on both sides with different kernels: ~1e-2 is bf16 noise; a wrong layer is ~1e0.
        ctx.expect(f"vLLM vs transformers, {name}", e < 0.05, f"relative error {e:.2e} (tol 0.05)")


SERVE_PROMPTS = [
    [{"role": "user", "content": "Write a Python function that returns the sum of a list."}],
    [{"role": "user", "content": "Explain what the argparse module does, briefly."}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "List three sorting algorithms."}],
    [{"role": "user", "content": "import collections\n\nclass Counter"}],
]


def serving(ctx: Context) -> None:
    from peagle.model import inspect_target
    from peagle.stage_io import local_path
    from peagle.train import TrainRunConfig, train
    from peagle.evaluate.vllm_job import run_in_subprocess

    target = ctx.target or _prepare_target(ctx)
    if ctx.dataset is None:
        raise RuntimeError("no hidden states to train on (the extraction section failed before writing them)")
    k = 4
    steps = 30 if ctx.cuda else 2
    cfg = TrainRunConfig.model_validate({
        "target": {"path": str(target)},
        "draft": {"arch": "llama", "num_layers": 1, "num_depths": k, "draft_vocab_size": min(8192, inspect_target(target).vocab_size)},
        "train": {"data": str(ctx.dataset), "output": str(ctx.work / "train-store"), "row_tokens": 2048 if ctx.cuda else 48,
                  "global_batch_rows": 2, "pad_to_multiple": 64 if ctx.cuda else 8, "val_fraction": 0.0, "epochs": 50,
                  "max_steps": steps, "lr": 1e-3, "embeddings": "train" if ctx.cuda else "frozen", "warmup_steps": 2, "checkpoint_every": 10_000, "log_every": 5 if
                  ctx.cuda else 1, "resume": False, "max_anchors": 256},
        "work_dir": str(ctx.work / "train-work")})
    t0 = time.perf_counter()
    result = train(cfg)
    wall = time.perf_counter() - t0
    m = result.metrics
    mfu = f", MFU {m['mfu']:.1%}" if "mfu" in m else ""
    ctx.expect(f"peagle.train.train, {steps} steps ({'flex, bf16' if ctx.cuda else 'dense, CPU'})",
               result.steps == steps and m.get("loss") == m.get("loss"),
               f"loss {m.get('loss', float('nan')):.3f}, {m.get('tokens_per_s', 0):,.0f} tok/s, "
               f"{m.get('model_tflops_per_s', 0):.3g} TFLOP/s{mfu}, {wall:.0f} s")
    if ctx.cuda:
        ctx.expect("trainer metrics carry MFU on CUDA", "mfu" in m, f"keys: {sorted(k for k in m if 'flop' in k or k == 'mfu')}")
    draft = local_path(result.final_uri)
    ctx.draft = Path(draft)

    workload = {"name": "greedy", "prompts": SERVE_PROMPTS, "max_tokens": 64, "temperature": 0.0, "ignore_eos": True}
    # float32: greedy identity is exact there; in bf16 a re-batched target may itself flip a near-tie.
    common = {"model": str(target), "dtype": "float32", "workloads": [workload],
              "engine": {"max_model_len": 1024, "gpu_memory_utilization": 0.3}}
    jobs = [dict(common), {**common, "draft": str(draft), "num_speculative_tokens": k}]
    if not ctx.cuda:
        ctx.add("vLLM serving (eagle3, parallel drafting, K = 4)", "SKIP",
                SKIP_CUDA + f"; draft at {draft}, {len(jobs)} engine jobs built")
        return
    base, spec = run_in_subprocess(jobs, timeout=480)
    b, s = base["workloads"][0], spec["workloads"][0]
    ctx.add("engine", "INFO", f"{spec.get('device')}; speculative_config {spec['speculative_config']}")
    sc = spec["speculative_config"] or {}
    ctx.expect("long form: eagle3, parallel drafting, K", sc.get("method") == "eagle3" and sc.get("parallel_drafting")
               and sc.get("num_speculative_tokens") == k, json.dumps(sc))
    sd = s["spec_decode"]
    counters_ok = (sd["drafts"] > 0 and sd["draft_tokens"] == k * sd["drafts"] and len(sd["accepted_per_pos"]) == k
                   and sum(sd["accepted_per_pos"]) == sd["accepted_tokens"])
    al = 1 + sd["accepted_tokens"] / sd["drafts"] if sd["drafts"] else float("nan")
    ctx.expect("spec-decode counters", counters_ok,
               f"drafts {sd['drafts']}, draft tokens {sd['draft_tokens']}, accepted {sd['accepted_tokens']} "
               f"(per position {sd['accepted_per_pos']}), AL {al:.2f}")
    same = s["token_ids"] == b["token_ids"]
    first = next((i for i, (x, y) in enumerate(zip(s["token_ids"], b["token_ids"])) if x != y), None)
    ctx.expect("greedy outputs == target alone (fp32)", same,
               f"{len(b['token_ids'])} prompts x {workload['max_tokens']} tokens" + ("" if same else f"; prompt {first} differs"))
    ctx.add("serving tokens/s", "INFO", f"target alone {b['generated_tokens'] / b['elapsed_s']:,.0f}, with draft "
                                        f"{s['generated_tokens'] / s['elapsed_s']:,.0f} tok/s (batch of {len(SERVE_PROMPTS)})")


def throughput(ctx: Context) -> None:
    """The trainer's step on an 8B-shaped draft: where the time goes, and MFU."""
    from peagle.train.flops import device_peak_flops, prepared_row_flops
    from peagle.train.optim import build_optimizer
    from peagle.train.settings import TrainSettings

    if ctx.cuda:  # Llama-3.1-8B: hidden 4096, 32 heads / 8 kv heads of 128, MLP 14336, vocab 128256
        spec = synthetic_spec(hidden=4096, heads=32, kv_heads=8, head_dim=128, intermediate=14336, vocab=128256,
                              draft_vocab=32000, num_layers=1, num_depths=4)
        row_tokens, rows_per_step, warmup, steps = 2048, 4, 2, 6
    else:
        spec = synthetic_spec(hidden=128, heads=4, kv_heads=2, head_dim=32, intermediate=256, vocab=2048,
                              draft_vocab=1024, num_layers=1, num_depths=4)
        row_tokens, rows_per_step, warmup, steps = 256, 2, 1, 2
    attention, bf16 = ("flex", True) if ctx.cuda else ("dense", False)
    hidden_dtype = torch.bfloat16 if ctx.cuda else torch.float32
    model, teacher = build_model(spec, ctx.device)
    opt = build_optimizer(model, TrainSettings())
    trainable = [p for p in model.parameters() if p.requires_grad]
    # Rows as the packer makes them: several documents per row, each a prompt then an answer.
    pool = [synthetic_samples(spec, [row_tokens // 4] * 4, seed=100 + i, prompt=row_tokens // 16)
            for i in range(rows_per_step)]
    times = {"data": 0.0, "forward": 0.0, "backward": 0.0, "optimizer": 0.0}
    tokens = flops = 0
    if ctx.cuda:
        torch.cuda.reset_peak_memory_stats(ctx.device)
    for step in range(warmup + steps):
        measured = step >= warmup
        n_sup = None
        for i, samples in enumerate(pool):
            t0 = time.perf_counter()
            row = make_row(spec, samples, seed=step * 1000 + i, dense=attention == "dense", hidden_dtype=hidden_dtype)
            if measured:
                flops += prepared_row_flops(spec, row)
                tokens += row.num_tokens
            row = row.to(ctx.device)
            ctx.sync()
            t1 = time.perf_counter()
            rl = row_forward(model, teacher, spec, row, attention, bf16)
            n_sup = n_sup or float(row.supervised.numel() * len(pool))
            ctx.sync()
            t2 = time.perf_counter()
            (rl.loss_sum / n_sup).backward()
            ctx.sync()
            t3 = time.perf_counter()
            if measured:
                times["data"] += t1 - t0
                times["forward"] += t2 - t1
                times["backward"] += t3 - t2
        t3 = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        ctx.sync()
        if measured:
            times["optimizer"] += time.perf_counter() - t3
    compute = times["forward"] + times["backward"] + times["optimizer"]
    step_s = sum(times.values()) / steps
    h = spec.hidden_size
    ctx.add("shape", "INFO", f"hidden {h}, {spec.num_layers} layer, K {spec.num_depths}, draft vocab "
                             f"{spec.draft_vocab_size}, {rows_per_step} rows x {row_tokens} tokens per step, "
                             f"{attention} attention, {'bf16 autocast' if bf16 else 'fp32'}")
    ctx.add("tokens/s", "INFO", f"{tokens / compute:,.0f} (compute) / {tokens / sum(times.values()):,.0f} "
                                f"(with data prep inline; the trainer prefetches it)")
    ctx.add("step split", "INFO", f"{step_s:.3f} s/step = " + ", ".join(
        f"{k} {v / steps:.3f} s ({v / sum(times.values()):.0%})" for k, v in times.items()))
    tflops = flops / compute / 1e12
    peak = device_peak_flops(ctx.device)
    ctx.add("model FLOPs", "INFO", f"{flops / tokens / 1e9:.3g} GFLOP per trained token (fwd+bwd), {tflops:.3g} TFLOP/s")
    if peak:
        mfu = flops / compute / peak
        ctx.add("MFU", "INFO", f"{mfu:.1%} (SpecForge: about {SPECFORGE_MFU:.0%})")
    else:
        ctx.add("MFU", "SKIP" if ctx.dry_run else "FAIL", "not reported: no bf16 peak for this device")
    if ctx.cuda:
        ctx.add("peak memory", "INFO", f"{torch.cuda.max_memory_allocated(ctx.device) / 2**30:.1f} GiB allocated")
    ctx.expect("step finite", all(p.isfinite().all() for p in trainable[:4]), "parameters finite after the steps")


# ----------------------------------------------------------------------------------------------


def speed(ctx: Context) -> None:
    """The evaluation's speed sweep on the GPU (peagle.evaluate.speed_sweep): the target alone and the serving
    section's draft at K = 1, 2, 4 over 1..64 requests in flight, one round, the chosen schedule served."""
    from peagle.engine.settings import EngineSettings
    from peagle.evaluate.speed_sweep import ladder_of, measure_speed, speed_ks, sweep_jobs
    from peagle.speed import SpeedSettings

    if ctx.draft is None:
        raise RuntimeError("no draft to measure (the serving section failed before training one)")
    settings = SpeedSettings(concurrencies=[1, 4, 16, 64], num_speculative_tokens=[1, 2, 4], rounds=1,
                             requests_per_load=2, min_requests=8, max_tokens=128)
    # eager: a compiled engine per configuration would spend the check's minutes on CUDA-graph capture
    engine = EngineSettings(max_model_len=1024, max_num_seqs=64, gpu_memory_utilization=0.3, enforce_eager=True)
    chats = [[{"role": "user", "content": p}] for p in SERVE_PROMPTS]
    if not ctx.cuda:
        jobs = sweep_jobs({"model": str(ctx.target)}, str(ctx.draft), speed_ks(settings, 4),
                          ladder_of(settings, chats, 128, 64), settings.rounds)
        ctx.add("speed per load (K = 1, 2, 4; 1..64 in flight)", "SKIP", SKIP_CUDA + f"; {len(jobs)} engine jobs built")
        return
    t0 = time.perf_counter()
    result = measure_speed(settings, target_dir=str(ctx.target or _prepare_target(ctx)), draft_dir=str(ctx.draft),
                           draft_sha256=None, trained_depths=4, engine=engine, dtype="bfloat16", seed=0,
                           chats=chats, max_tokens=128, raw_log=ctx.work / "speed_timings.json")
    for p in result.table.points:
        r = p.speedup
        ratio = "" if r is None else f", x{r.value:.2f} [{r.low:.2f}-{r.high:.2f}]"
        ctx.add(f"speed {p.config} at {p.concurrency}", "INFO",
                f"{p.tokens_per_s:,.0f} tok/s{ratio}, TPOT p50 {p.tpot_s.p50 * 1000:.1f} ms, "
                f"TTFT p50 {p.ttft_s.p50 * 1000:.0f} ms")
    sched = result.schedule
    ctx.expect("schedule chosen and served", all(m.served is not None for m in sched.measured)
               or sched.single_k is not None, f"{sched.describe()} ({time.perf_counter() - t0:.0f} s)")


def run(ctx: Context, names: list[str]) -> int:
    for name in names:
        ctx.section = name
        before = len(ctx.checks)
        t0 = time.perf_counter()
        try:
            globals()[name](ctx)
        except Exception as exc:  # noqa: BLE001 - a failing section is a FAIL row, the run goes on
            tb = traceback.extract_tb(exc.__traceback__)
            where = f" at {Path(tb[-1].filename).name}:{tb[-1].lineno}" if tb else ""
            ctx.add("section", "FAIL", f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]
                    + where)
            traceback.print_exc(file=sys.stderr)
        if len(ctx.checks) == before:
            ctx.add("section", "FAIL", "recorded no check")
        print(f"[gpu_check] {name}: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    return 1 if any(c.status == "FAIL" for c in ctx.checks) else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="CPU only: small shapes, gloo, dense attention, no vLLM")
    ap.add_argument("--work", default=None, help="scratch directory (default: a fresh temporary one)")
    ap.add_argument("--target", default=None, help="a prepared target directory instead of the embedded SmolLM2 "
                    "(prepare-target takes minutes on a small CPU; the test passes a tiny one)")
    ap.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated sections of {', '.join(SECTIONS)}")
    args = ap.parse_args(argv)
    names = [n.strip() for n in args.only.split(",") if n.strip()]
    bad = [n for n in names if n not in SECTIONS]
    if bad:
        ap.error(f"--only: unknown section(s) {bad}; choose from {', '.join(SECTIONS)}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    cuda = torch.cuda.is_available() and not args.dry_run
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    with contextlib.ExitStack() as stack:
        work = Path(args.work) if args.work else Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="gpu-check-")))
        work.mkdir(parents=True, exist_ok=True)
        ctx = Context(dry_run=args.dry_run, work=work, device=device,
                      target=Path(args.target).resolve() if args.target else None)
        t0 = time.perf_counter()
        rc = run(ctx, names)
        print_table(ctx.checks, time.perf_counter() - t0)
    return rc


if __name__ == "__main__":
    sys.exit(main())
