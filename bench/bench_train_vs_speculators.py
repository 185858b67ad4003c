"""Training-step throughput: our P-EAGLE trainer vs speculators 0.9.0's, same tiny config, same data, on CPU.

Not a test: it prints figures measured side by side in one run (they depend on the machine and its load).

What runs. The orchestrator (this file, run with the project's venv) writes once, into ``--work``:

* a tiny random Qwen3 verifier (hidden 256, 8 layers, 4 heads / 2 KV heads, vocab 512; bf16 safetensors
  and a word-level tokenizer) that both sides read;
* ``samples.safetensors``: warm-up + timed samples of ``--seq-len`` tokens each (random token ids,
  random aux features [T, 3H] and last hidden states [T, H], float32; the first ``--prompt-len``
  tokens unsupervised, the rest supervised). One sample = one packed row = one optimiser step.

Then it starts one worker per side, ``--rounds`` times, alternating which side goes first (ours, theirs,
theirs, ours, ...); each worker is a fresh process with ``--threads`` torch threads (default 1: on a
2-core box shared with other jobs two threads spin against each other and the step time multiplies),
and trains the same draft shape on those samples:

* ours (``sys.executable``): ``peagle.train.train`` -- our real training loop -- on a ``ListDataset`` of
  the samples; 1 row per step, AdamW, dense SDPA masks (the CPU path), KL loss, fp32, prefetch thread
  as configured (``--prefetch``, default 2 = the trainer default), metrics logged every step.
* theirs (``--speculators-python``, a separate venv; speculators is never imported into the project):
  ``PEagleDraftModel.from_training_args`` (their CLI's build path, with the draft layer config from
  their ``create_transformer_layer_config``), their ``Trainer`` (AdamW, linear schedule), their data
  path (``BaseDataset`` + ``CollateFn`` with ``shift_batch``) in a ``torch.utils.data.DataLoader``, and
  ``Trainer.train_epoch`` -- their real per-step loop -- with ``--draft-attn-impl sdpa`` (dense mask via
  flex ``create_mask``; their default flex BlockMask has no CPU backward) and
  ``--loss-implementation eager`` (their default fused loss is a Triton kernel, GPU only).
  Changes to their code path, both for CPU: ``speculators.train.distributed._local_rank`` is set to
  "cpu", because their Trainer moves the model and batches to ``local_rank`` (the integer 0 = cuda:0);
  the trainer's step counter starts at 1, because its step-0 profiler calls
  ``torch.accelerator.synchronize()``, which raises without an accelerator.

Both sides: 1 draft layer (qwen3 arch, full attention), ``--num-depths`` 4, full draft vocabulary,
trainable embeddings + ``mask_hidden``, frozen lm_head, mask token = last id, COD r / r_min /
max_anchors 0.7 / 0.2 / 512, fp32 (their ``autocast("cuda")`` is disabled on a CPU-only host).

Timed step on each side = from the end of one optimiser step to the end of the next (ours: clocked where
the loop prints its per-step progress line; theirs: ``train_epoch``'s ``step_callback``): fetch/prepare
the row (ours: pack + shift + COD + dense masks, on the prefetch thread; theirs: collate + shift in the
DataLoader, COD + mask inside forward), forward, loss, backward, grad clip, optimiser and scheduler
step, metric bookkeeping. The first ``--warmup`` steps are not timed. Trained tokens per step = tokens of
the samples in the packed row (1024 on both sides). S = P-EAGLE elements per step (depth-0 rows + COD
rollout elements), recorded by a thin wrapper around each side's COD sampler.

Printed per side: steps/s and tokens/s over all timed steps, the median step time and tokens/s at the
median, the median process CPU time per step (all threads; far less sensitive than wall time to other
jobs on a shared machine), tokens and S per step. The one ratio printed is ours / theirs of tokens/s at
the median step time.

Setup of the speculators venv (outside the repository; pin the CPU torch first so pip never pulls CUDA):

    python3 -m venv /tmp/spec-venv
    /tmp/spec-venv/bin/pip install torch==2.13.0
    /tmp/spec-venv/bin/pip install speculators==0.9.0 "transformers==5.19.0" "torch==2.13.0"
    /tmp/spec-venv/bin/pip uninstall -y torchvision torchaudio   # pulled by speculators; they break
                                                                 # `import transformers` beside the CPU torch

Run:

    .venv/bin/python bench/bench_train_vs_speculators.py --speculators-python /tmp/spec-venv/bin/python \\
        [--seq-len 1024 --steps 20 --warmup 2 --rounds 4 --threads 1 --work /tmp/bench-train-vs-spec]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

from harness import banner, format_table, log_tail, run_logged

HERE = Path(__file__).resolve()


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--speculators-python", default="/tmp/spec-venv/bin/python",
                    help="python of the venv holding speculators==0.9.0 (see the setup above)")
    ap.add_argument("--work", default="/tmp/bench-train-vs-spec", help="scratch directory (target, data, outputs)")
    ap.add_argument("--seq-len", type=int, default=1024, help="tokens per packed row (= per step)")
    ap.add_argument("--prompt-len", type=int, default=256, help="unsupervised prefix of every sample")
    ap.add_argument("--steps", type=int, default=20, help="timed steps per worker")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps before them")
    ap.add_argument("--rounds", type=int, default=4, help="worker runs per side, alternating who goes first")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads in each worker (default 1: on a shared 2-core box two threads spin)")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--target-layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--num-layers", type=int, default=1, help="draft decoder layers")
    ap.add_argument("--num-depths", type=int, default=4)
    ap.add_argument("--cod-ratio", type=float, default=0.7)
    ap.add_argument("--cod-ratio-min", type=float, default=0.2)
    ap.add_argument("--max-anchors", type=int, default=512)
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--prefetch", type=int, default=2, help="ours: rows prepared ahead by the background thread")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--worker", choices=["ours", "theirs"], help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


# ----------------------------------------------------------------------------------------------
# Shared inputs (orchestrator, project venv)


def build_target(args, out: Path) -> Path:
    """A tiny random Qwen3 verifier with a word-level tokenizer, in HF layout."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    stamp = json.dumps({k: getattr(args, k) for k in ("vocab", "hidden", "target_layers", "seq_len", "seed")})
    if (out / "bench-stamp.json").is_file() and (out / "bench-stamp.json").read_text() == stamp:
        return out
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    vocab = {f"t{i}": i for i in range(args.vocab - 1)}
    vocab["<unk>"] = args.vocab - 1
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>").save_pretrained(str(out))
    torch.manual_seed(args.seed)
    cfg = Qwen3Config(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                      num_hidden_layers=args.target_layers, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=args.hidden // 4, max_position_embeddings=max(4096, 2 * args.seq_len),
                      rms_norm_eps=1e-6, tie_word_embeddings=False)
    model = Qwen3ForCausalLM(cfg).to(torch.bfloat16)
    model.config.dtype = "bfloat16"
    model.save_pretrained(str(out))
    (out / "bench-stamp.json").write_text(stamp)
    return out


def build_samples(args, path: Path) -> Path:
    import torch
    from safetensors.torch import save_file

    n = args.warmup + args.steps
    g = torch.Generator().manual_seed(args.seed + 1)
    t, h = args.seq_len, args.hidden
    loss_mask = torch.zeros(n, t, dtype=torch.long)
    loss_mask[:, args.prompt_len:] = 1
    save_file({
        # ids < vocab - 1: the last id is the mask token of both drafts
        "input_ids": torch.randint(0, args.vocab - 1, (n, t), generator=g),
        "loss_mask": loss_mask,
        "aux_hidden": torch.randn(n, t, 3 * h, generator=g),
        "last_hidden": torch.randn(n, t, h, generator=g),
    }, str(path))
    return path


# ----------------------------------------------------------------------------------------------
# Worker: ours (project venv)


def worker_ours(args) -> dict:
    import torch
    from safetensors.torch import load_file

    import peagle.train.cod as cod_mod  # sample_elements looks sample_cod up here
    from peagle.config import DraftSettings, TargetSettings
    from peagle.model.target import default_aux_layer_ids, fingerprint
    from peagle.train import loop as loop_mod, metrics_log
    from peagle.train.data import DatasetInfo, ListDataset
    from peagle.train.settings import TrainRunConfig, TrainSettings

    torch.set_num_threads(args.threads)
    work = Path(args.work)
    target = work / "target"
    data = load_file(str(work / "samples.safetensors"))
    n = data["input_ids"].shape[0]
    aux_ids = default_aux_layer_ids(args.target_layers)
    info = DatasetInfo(aux_ids, args.hidden, fingerprint(target))
    dataset = ListDataset(info, [{"sample_id": f"s{i}", "input_ids": data["input_ids"][i],
                                  "loss_mask": data["loss_mask"][i], "aux_hidden": data["aux_hidden"][i],
                                  "last_hidden": data["last_hidden"][i]} for i in range(n)])

    sizes: list[int] = []
    real_sample_cod = cod_mod.sample_cod

    def recording_sample_cod(*a, **kw):
        cod = real_sample_cod(*a, **kw)
        sizes.append(int(cod.anchors.numel()))
        return cod

    cod_mod.sample_cod = recording_sample_cod

    run = work / f"ours-run-{os.getpid()}"
    cfg = TrainRunConfig(
        target=TargetSettings(path=str(target)),
        draft=DraftSettings(arch="qwen3", num_layers=args.num_layers, num_depths=args.num_depths,
                            mask_token_id=args.vocab - 1, aux_layer_ids=aux_ids),
        train=TrainSettings(output=str(run / "out"), seed=args.seed, row_tokens=args.seq_len, global_batch_rows=1,
                            pad_to_multiple=64, val_fraction=0.0, prefetch=args.prefetch,
                            cod_ratio=args.cod_ratio, cod_ratio_min=args.cod_ratio_min, max_anchors=args.max_anchors,
                            loss="kl", epochs=1, max_steps=n, lr=args.lr, checkpoint_every=10 * n, log_every=1,
                            attention="dense", resume=False),
        work_dir=str(run / "work"),
    )
    # With log_every=1 the loop prints one progress line per step, right after the step's optimiser and
    # scheduler step and its metrics line: clock the step ends there (wall and process CPU time).
    ends: list[tuple[float, float]] = []
    real_print_progress = metrics_log.print_progress

    def clocked_print_progress(m, *a, **kw):
        if not any(k.startswith("val_") for k in m):
            ends.append((time.perf_counter(), time.process_time()))
        return real_print_progress(m, *a, **kw)

    metrics_log.print_progress = clocked_print_progress
    trained: list[int] = []
    real_build_optimizer = loop_mod.build_optimizer

    def counting_build_optimizer(model, settings):
        opt = real_build_optimizer(model, settings)
        trained.append(sum(p.numel() for g in opt.param_groups for p in g["params"] if p.requires_grad))
        return opt

    loop_mod.build_optimizer = counting_build_optimizer
    loop_mod.train(cfg, dataset)
    lines = [json.loads(x) for x in (run / "work" / "metrics.jsonl").read_text().splitlines() if x.strip()]
    lines = [m for m in lines if "tokens" in m]
    shutil.rmtree(run, ignore_errors=True)  # checkpoints and the exported draft
    assert len(lines) == n == len(ends), f"expected {n} steps, got {len(lines)} metric lines / {len(ends)} ends"
    return {"side": "ours", **step_times(ends, args.warmup), "step_tokens": [m["tokens"] for m in lines[args.warmup:]],
            "elements": sizes[args.warmup:], "trained_params": trained[0]}


def step_times(ends: list[tuple[float, float]], warmup: int) -> dict:
    """Wall and process-CPU seconds of each step after the warm-up, from (wall, cpu) clocks at step ends."""
    pairs = list(zip(ends[warmup - 1:], ends[warmup:]))
    return {"step_seconds": [b[0] - a[0] for a, b in pairs], "step_cpu": [b[1] - a[1] for a, b in pairs]}


# ----------------------------------------------------------------------------------------------
# Worker: theirs (speculators venv; imports nothing from the project)


def worker_theirs(args) -> dict:
    import torch
    from safetensors.torch import load_file
    from torch.utils.data import DataLoader

    import speculators.models.peagle.core as peagle_core
    import speculators.train.distributed as spec_dist
    from speculators.models.eagle3.data import shift_batch
    from speculators.models.peagle import PEagleDraftModel
    from speculators.train.cli import create_transformer_layer_config
    from speculators.train.data import BaseDataset, CollateFn
    from speculators.train.trainer import Trainer, TrainerConfig

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    work = Path(args.work)
    target = str(work / "target")
    data = load_file(str(work / "samples.safetensors"))
    n = data["input_ids"].shape[0]

    # Their CLI's draft construction (speculators.train.cli.build_draft_model without --from-pretrained),
    # all draft layers full attention (ours has no sliding window either).
    layer_cfg = create_transformer_layer_config(
        verifier_name_or_path=target, num_layers=args.num_layers, draft_arch="qwen3", hidden_act="silu",
        sliding_window=2048, full_attention_indices=list(range(args.num_layers)))
    model = PEagleDraftModel.from_training_args(
        verifier_config=layer_cfg, t2d=None, d2t=None, verifier_name_or_path=target, draft_vocab_size=args.vocab,
        norm_before_residual=False, mask_token_id=args.vocab - 1, num_depths=args.num_depths,
        draft_attn_impl="sdpa")
    train_kwargs, _ = PEagleDraftModel.get_trainer_kwargs(
        loss_fn="kl_div", loss_implementation="eager", max_anchors=args.max_anchors, num_depths=args.num_depths,
        down_sample_ratio=args.cod_ratio, down_sample_ratio_min=args.cod_ratio_min)

    sizes: list[int] = []
    real_cod = peagle_core.generate_cod_sample_indices

    def recording_cod(*a, **kw):
        anchor_pos, depth = real_cod(*a, **kw)
        sizes.append(int(anchor_pos.shape[0]))
        return anchor_pos, depth

    peagle_core.generate_cod_sample_indices = recording_cod

    class Samples(BaseDataset):  # their dataset base: adds lengths / position_ids per sample
        def _compute_approx_lengths(self):
            return [args.seq_len] * n

        def _get_raw_data(self, index):
            return {"hidden_states": data["aux_hidden"][index], "input_ids": data["input_ids"][index],
                    "verifier_last_hidden_states": data["last_hidden"][index], "loss_mask": data["loss_mask"][index]}

        def __len__(self):
            return n

    # fp32 hidden states: on CPU their autocast("cuda", bf16) is disabled, and bf16 features would meet
    # fp32 weights. Ours trains in fp32 on CPU as well.
    collate = CollateFn(args.seq_len, args.hidden, 3, dtype=torch.float32, preprocess=shift_batch)
    loader = DataLoader(Samples(args.seq_len, torch.float32), batch_size=1, shuffle=False, num_workers=0,
                        collate_fn=collate)

    spec_dist._local_rank = "cpu"  # their Trainer calls .to(local_rank); 0 would mean cuda:0
    config = TrainerConfig(lr=args.lr, num_epochs=1, save_path=str(work / f"theirs-run-{os.getpid()}"),
                           train_call_kwargs=train_kwargs, val_call_kwargs=train_kwargs, optimizer="adamw",
                           weight_decay=0.01, scheduler_type="linear", hidden_states_dtype=torch.float32,
                           log_freq=10 ** 9, max_steps=n + 1)
    trainer = Trainer(model, config, loader, None)
    # Their per-step profiler runs when global_step % log_freq == 0, i.e. always at step 0, and calls
    # torch.accelerator.synchronize(), which raises without an accelerator: start counting at 1 (the
    # profiler then stays off, as it does on GPU for every step but each log_freq-th).
    trainer.global_step = 1

    ends: list[tuple[float, float]] = []
    trainer.train_epoch(0, step_callback=lambda: ends.append((time.perf_counter(), time.process_time())))
    assert len(ends) == n, f"expected {n} steps, got {len(ends)}"
    shutil.rmtree(config.save_path, ignore_errors=True)
    # trained tokens per step = tokens of the samples in the row, as ours counts them (their own profiler counts
    # the row after the one-token shift: one fewer per sample)
    dataset = Samples(args.seq_len, torch.float32)
    tokens = [int(dataset[i]["lengths"].sum()) for i in range(args.warmup, n)]
    trained = sum(p.numel() for opt in trainer.optimizers for g in opt.param_groups for p in g["params"]
                  if p.requires_grad)
    return {"side": "theirs", **step_times(ends, args.warmup), "step_tokens": tokens, "elements": sizes[args.warmup:],
            "trained_params": trained}


# ----------------------------------------------------------------------------------------------
# Orchestrator


def run_worker(args, side: str, python: str, index: int) -> dict:
    out = Path(args.work) / f"result-{side}-{index}.json"
    cmd = [python, str(HERE), "--worker", side, "--out", str(out)]
    for k in ("work", "seq_len", "prompt_len", "steps", "warmup", "threads", "hidden", "target_layers", "vocab",
              "num_layers", "num_depths", "cod_ratio", "cod_ratio_min", "max_anchors", "lr", "prefetch", "seed"):
        cmd += [f"--{k.replace('_', '-')}", str(getattr(args, k))]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads),
               TOKENIZERS_PARALLELISM="false", PYTHONWARNINGS="ignore")
    if side == "theirs":
        env.pop("PYTHONPATH", None)  # nothing of the project in the speculators process
    log = Path(args.work) / f"log-{side}-{index}.txt"
    rc, _ = run_logged(cmd, log, env, cwd=args.work)
    if rc != 0:
        raise SystemExit(f"{side} worker failed (exit {rc}); log {log}:\n{log_tail(log)}")
    return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        result = (worker_ours if args.worker == "ours" else worker_theirs)(args)
        Path(args.out).write_text(json.dumps(result))
        return
    if args.warmup < 1:
        raise SystemExit("--warmup must be >= 1")
    if not Path(args.speculators_python).exists():
        raise SystemExit(f"{args.speculators_python} not found; create the speculators venv first (see --help)")
    work = Path(args.work).resolve()
    args.work = str(work)  # the workers run with cwd = work
    work.mkdir(parents=True, exist_ok=True)
    build_target(args, work / "target")
    build_samples(args, work / "samples.safetensors")
    print(f"config: verifier Qwen3 hidden {args.hidden}, {args.target_layers} layers, vocab {args.vocab}; draft "
          f"{args.num_layers} layer(s), {args.num_depths} depths, full draft vocab; rows of {args.seq_len} tokens "
          f"({args.prompt_len} unsupervised); COD r={args.cod_ratio} r_min={args.cod_ratio_min} "
          f"max_anchors={args.max_anchors}; AdamW; fp32; {args.threads} torch threads; "
          f"{args.warmup} warm-up + {args.steps} timed steps per worker, {args.rounds} round(s)", flush=True)

    results: dict[str, list[dict]] = {"ours": [], "theirs": []}
    sides = [("ours", sys.executable), ("theirs", args.speculators_python)]
    for r in range(args.rounds):
        for side, python in (sides if r % 2 == 0 else sides[::-1]):  # alternate who goes first
            res = run_worker(args, side, python, r)
            results[side].append(res)
            sec, tok = sum(res["step_seconds"]), sum(res["step_tokens"])
            print(f"  round {r} {side:6s}: {len(res['step_seconds']) / sec:.3f} steps/s, {tok / sec:,.0f} tokens/s, "
                  f"median step {statistics.median(res['step_seconds']) * 1e3:.0f} ms "
                  f"(CPU {statistics.median(res['step_cpu']) * 1e3:.0f} ms), "
                  f"S mean {statistics.mean(res['elements']):.0f}, trained params {res['trained_params']:,}",
                  flush=True)

    summary = {}
    for side, runs in results.items():
        secs = [x for r in runs for x in r["step_seconds"]]
        toks = [x for r in runs for x in r["step_tokens"]]
        elements = [e for r in runs for e in r["elements"]]
        tok_per_step = statistics.mean(toks)
        cpu = [x for r in runs for x in r["step_cpu"]]
        summary[side] = dict(steps=len(secs), mean_sps=len(secs) / sum(secs), mean_tps=sum(toks) / sum(secs),
                             median_s=statistics.median(secs), median_tps=tok_per_step / statistics.median(secs),
                             median_cpu=statistics.median(cpu), tok_per_step=tok_per_step,
                             s_mean=statistics.mean(elements), s_min=min(elements), s_max=max(elements))
    print(banner())
    print(format_table(["side", "steps", "steps/s", "tokens/s", "median step ms", "tokens/s@median", "CPU s/step",
                        "tokens/step", "S/step mean (min-max)"],
                       [["ours" if side == "ours" else "speculators", m["steps"], f"{m['mean_sps']:.3f}",
                         f"{m['mean_tps']:,.0f}", f"{m['median_s'] * 1e3:.0f}", f"{m['median_tps']:,.0f}",
                         f"{m['median_cpu']:.3f}", f"{m['tok_per_step']:.0f}",
                         f"{m['s_mean']:.0f} ({m['s_min']}-{m['s_max']})"] for side, m in summary.items()]))
    print("(steps/s, tokens/s: all timed steps / all timed seconds; tokens/s@median: tokens per step / median step "
          "time, robust to load spikes from other jobs; CPU s/step: median process CPU time per step, all threads)")
    ratio = summary["ours"]["median_tps"] / summary["theirs"]["median_tps"]
    print(f"ratio ours/speculators trained tokens/s (median step): {ratio:.2f}x  (goal >= 1.0)")


if __name__ == "__main__":
    main()
