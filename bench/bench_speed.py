"""Speed per load, side by side in one run: the target alone, a speculators 0.9 draft of the same target,
the peagle draft at a fixed K = 4, and the peagle draft with its schedule. Prints tokens/s ratios per concurrency.

Not a test: the figures depend on the machine and its load; they are measured together, in one run, with the
configurations interleaved round by round (forward, then backward), so a slow spell falls on all of them.

Inputs: a finished run of the main job (``./dev run``; default: the newest under ``runs/local``):

* its target (``models/target``) and its peagle draft (``models/draft``);
* its evaluation's speed table (``evaluate/report.json``): the peagle draft's schedule is the one the current
  rule (:func:`peagle.speed.schedule.choose_schedule`) chooses from that table (``--schedule`` overrides);
* its extracted hidden states (``hidden_states/train``): what the speculators draft trains on.

The speculators draft (``--speculators-draft DIR`` to bring one; otherwise trained here, once, and kept in
``--work``): speculators 0.9.0's own ``PEagleDraftModel.from_training_args`` and ``Trainer.run_training`` in a
separate venv (``--speculators-python``; speculators is never imported into the project), with the same shape
as the run's draft (one qwen3 layer, its depths, its mask token, its draft vocabulary: the run's ``t2d`` /
``d2t``), the same samples (the run's hidden states: the target's own responses), rows of the run's
``train.row_tokens`` packed by their multipack sampler, AdamW with the run's learning rate, weight decay, epochs
and warm-up, a cosine schedule, their COD sampler (0.7 / 0.2, 512 anchors) and KL loss (their eager
implementation: the fused one is a GPU kernel), float32, dense SDPA masks (their flex path has no CPU backward).
CPU-only changes to their path, as in ``bench_train_vs_speculators.py``: ``_local_rank`` = "cpu", the step
counter starting at 1 (their step-0 profiler needs an accelerator).

Serving: every configuration is a vLLM engine of its own (``peagle.evaluate.vllm_job``: the evaluation's
engine code and its load ladder), with the run's evaluate engine settings; greedy; the same prompts
(``--prompts``). Printed: the speculators draft's acceptance next to ours, then per concurrency each
configuration's tokens/s and its ratio to the target alone with a 95% bootstrap interval, TPOT p50, and where
an engine step's time goes (the draft's milliseconds per step).

Setup of the speculators venv: see ``bench_train_vs_speculators.py``. Run:

    .venv/bin/python bench/bench_speed.py [--run runs/local/pipeline/runs/local-...] \\
        [--speculators-python /tmp/spec-venv/bin/python] [--concurrencies 1 4 16 --rounds 2]
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from harness import banner, format_table, log_tail, run_logged

HERE = Path(__file__).resolve()
ROOT = HERE.parent.parent
CONFIGS = ("target", "speculators K=4", "peagle K=4", "peagle schedule")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", help="a finished run directory (default: the newest runs/local/pipeline/runs/*)")
    ap.add_argument("--speculators-python", default="/tmp/spec-venv/bin/python")
    ap.add_argument("--speculators-draft", help="a speculators draft to serve instead of training one")
    ap.add_argument("--work", default="/tmp/bench-speed")
    ap.add_argument("--concurrencies", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--k", type=int, default=4, help="the fixed K of both drafts")
    ap.add_argument("--prompts", default="sharegpt-heldout@48")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--requests-per-load", type=int, default=2, help="requests at concurrency c: this many times c ...")
    ap.add_argument("--min-requests", type=int, default=8, help="... and at least this many")
    ap.add_argument("--schedule", help="the peagle schedule as JSON ranges, e.g. '[[1,1,1],[2,16,0]]'")
    ap.add_argument("--epochs", type=int, help="speculators training epochs (default: the run's train.epochs)")
    ap.add_argument("--worker", choices=["train-theirs"], help=argparse.SUPPRESS)
    ap.add_argument("--spec", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


# ----------------------------------------------------------------------------------------------
# Worker: train the speculators draft (speculators venv; imports nothing from the project)


def worker_train_theirs(spec: dict) -> None:
    import torch
    from safetensors.torch import load_file

    import speculators.train.distributed as spec_dist
    from speculators.models.eagle3.data import shift_batch
    from speculators.models.peagle import PEagleDraftModel
    from speculators.train.cli import create_transformer_layer_config
    from speculators.train.data import BaseDataset
    from speculators.train.dataloader import _setup_dataloader
    from speculators.train.trainer import Trainer, TrainerConfig

    torch.manual_seed(spec["seed"])
    data = load_file(spec["samples"])
    offsets = data["offsets"].tolist()
    n = len(offsets) - 1
    hidden = int(data["last_hidden"].shape[-1])
    layer_cfg = create_transformer_layer_config(
        verifier_name_or_path=spec["target"], num_layers=1, draft_arch="qwen3", hidden_act="silu",
        sliding_window=2048, full_attention_indices=[0])
    model = PEagleDraftModel.from_training_args(
        verifier_config=layer_cfg, t2d=data["t2d"], d2t=data["d2t"], verifier_name_or_path=spec["target"],
        draft_vocab_size=int(data["d2t"].numel()), norm_before_residual=False, mask_token_id=spec["mask_token_id"],
        num_depths=spec["num_depths"], draft_attn_impl="sdpa")
    train_kwargs, _ = PEagleDraftModel.get_trainer_kwargs(
        loss_fn="kl_div", loss_implementation="eager", max_anchors=512, num_depths=spec["num_depths"],
        down_sample_ratio=0.7, down_sample_ratio_min=0.2)

    class Samples(BaseDataset):  # the run's samples, one per conversation turn extracted
        def _compute_approx_lengths(self):
            return [offsets[i + 1] - offsets[i] for i in range(n)]

        def _get_raw_data(self, index):
            a, b = offsets[index], offsets[index + 1]
            return {"hidden_states": data["aux_hidden"][a:b].float().reshape(b - a, -1),
                    "input_ids": data["token_ids"][a:b].long(),
                    "verifier_last_hidden_states": data["last_hidden"][a:b].float(),
                    "loss_mask": data["loss_mask"][a:b].long()}

        def __len__(self):
            return n

    loader = _setup_dataloader(Samples(spec["row_tokens"], torch.float32), spec["row_tokens"], hidden, num_workers=0,
                               prefetch_factor=None, preprocess=shift_batch, seed=spec["seed"])
    spec_dist._local_rank = "cpu"  # their Trainer calls .to(local_rank); 0 would mean cuda:0
    config = TrainerConfig(lr=spec["lr"], num_epochs=spec["epochs"], save_path=spec["out"],
                           train_call_kwargs=train_kwargs, val_call_kwargs=train_kwargs, optimizer="adamw",
                           weight_decay=spec["weight_decay"], scheduler_type="cosine",
                           scheduler_warmup_steps=spec["warmup_steps"], hidden_states_dtype=torch.float32,
                           log_freq=10 ** 9)
    trainer = Trainer(model, config, loader, None)
    trainer.global_step = 1  # their step-0 profiler synchronises an accelerator (see the module docstring)
    t = time.perf_counter()
    trainer.run_training()
    Path(spec["out"], "bench-train.json").write_text(json.dumps(
        {"seconds": time.perf_counter() - t, "steps": trainer.global_step - 1, "samples": n}))


# ----------------------------------------------------------------------------------------------
# Orchestrator (project venv)


def newest_run() -> Path:
    runs = sorted((ROOT / "runs" / "local" / "pipeline" / "runs").glob("*/run.json"), key=lambda p: p.stat().st_mtime)
    if not runs:
        raise SystemExit("no finished run under runs/local: run ./dev run first, or give --run")
    return runs[-1].parent


def write_samples(run: Path, out: Path) -> int:
    """The run's hidden-state shards as one file of concatenated samples, with the draft's vocabulary maps."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    parts: dict[str, list] = {"token_ids": [], "aux_hidden": [], "last_hidden": [], "loss_mask": []}
    offsets = [0]
    for shard in sorted((run / "hidden_states" / "train").glob("hs-*/*.safetensors")):
        with safe_open(str(shard), "pt") as f:
            t = {k: f.get_tensor(k) for k in f.keys()}
        base = offsets[-1]
        offsets += [base + int(o) for o in t["offsets"][1:].tolist()]
        for k in parts:
            parts[k].append(t[k])
    draft = load_file(str(run / "models" / "draft" / "model.safetensors"))
    save_file({"offsets": torch.tensor(offsets, dtype=torch.int64),
               **{k: torch.cat(v).contiguous() for k, v in parts.items()},
               "t2d": draft["t2d"], "d2t": draft["d2t"]}, str(out))
    return len(offsets) - 1


def train_theirs(args, run: Path, config: dict, work: Path) -> Path:
    out = work / "speculators-draft"
    done = out / "bench-train.json"
    if done.is_file():
        print(f"speculators draft: kept from an earlier run of this bench ({out})", flush=True)
    else:
        if not Path(args.speculators_python).exists():
            raise SystemExit(f"{args.speculators_python} not found: create the speculators venv "
                             "(bench_train_vs_speculators.py --help) or give --speculators-draft")
        n = write_samples(run, work / "samples.safetensors")
        draft_cfg = json.loads((run / "models" / "draft" / "config.json").read_text())
        train = config["train"]
        spec = {"samples": str(work / "samples.safetensors"), "target": str(run / "models" / "target"),
                "out": str(out), "seed": train["seed"], "row_tokens": train["row_tokens"], "lr": train["lr"],
                "weight_decay": train["weight_decay"], "warmup_steps": train["warmup_steps"],
                "epochs": args.epochs or train["epochs"], "mask_token_id": draft_cfg["mask_token_id"],
                "num_depths": config["draft"]["num_depths"]}
        (work / "train-spec.json").write_text(json.dumps(spec))
        print(f"training the speculators draft on the run's {n} samples ({spec['epochs']} epochs) ...", flush=True)
        env = dict(os.environ, PYTHONWARNINGS="ignore", TOKENIZERS_PARALLELISM="false")
        env.pop("PYTHONPATH", None)
        log = work / "train-theirs.log"
        rc, _ = run_logged([args.speculators_python, str(HERE), "--worker", "train-theirs", "--spec",
                            str(work / "train-spec.json")], log, env, cwd=str(work))
        if rc != 0:
            raise SystemExit(f"speculators training failed (exit {rc}); log {log}:\n{log_tail(log)}")
    info = json.loads(done.read_text())
    print(f"speculators draft: {info['steps']} steps over {info['samples']} samples in {info['seconds']:.0f} s", flush=True)
    epochs = sorted((p for p in out.iterdir() if (p / "config.json").is_file()), key=lambda p: p.stat().st_mtime)
    return epochs[-1]


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.worker:
        worker_train_theirs(json.loads(Path(args.spec).read_text()))
        return
    from peagle.evaluate.prompts import load_prompt_sets
    from peagle.evaluate.report import Report
    from peagle.evaluate.vllm_job import run_in_subprocess
    from peagle.speed.schedule import choose_schedule, given_schedule
    from peagle.speed.table import build_table, steps_of, timings_of

    run = Path(args.run).resolve() if args.run else newest_run()
    config = json.loads((run / "run.json").read_text())["config"]
    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    print(banner(), flush=True)
    print(f"run: {run}", flush=True)
    theirs = Path(args.speculators_draft).resolve() if args.speculators_draft else train_theirs(args, run, config, work)

    engine_cfg = {**config["evaluate"]["engine"], "timeout_s": None}
    max_num_seqs = engine_cfg.get("max_num_seqs") or 16
    report = Report.read(run / "evaluate")
    if args.schedule:
        schedule = given_schedule(json.loads(args.schedule), report.speed.table, max_num_seqs)
    else:
        schedule = choose_schedule(report.speed.table, max_num_seqs)
    print(f"peagle schedule (the current rule on the run's own sweep): {schedule.describe()}", flush=True)

    sets = load_prompt_sets([args.prompts])
    chats = [p.chat() for s in sets.values() for p in s.prompts]
    loads = [c for c in args.concurrencies if c <= max_num_seqs]
    ladder = {"prompts": chats, "concurrencies": loads, "per_load": args.requests_per_load, "min_requests": args.min_requests,
              "max_tokens": args.max_tokens}
    common = {"model": str(run / "models" / "target"), "dtype": config["evaluate"]["dtype"], "seed": 0,
              "engine": engine_cfg, "warmup": True, "ladder": ladder}
    ours = str(run / "models" / "draft")
    jobs_by_config = {
        "target": {},
        "speculators K=4": {"draft": str(theirs), "num_speculative_tokens": args.k},
        "peagle K=4": {"draft": ours, "num_speculative_tokens": args.k},
        "peagle schedule": ({"draft": ours, "num_speculative_tokens": schedule.num_speculative_tokens,
                             **({"num_speculative_tokens_per_batch_size": schedule.vllm_ranges()}
                                if schedule.single_k is None else {})}
                            if schedule.num_speculative_tokens else {}),
    }
    jobs = []
    for r in range(args.rounds):
        order = list(CONFIGS) if r % 2 == 0 else list(CONFIGS)[::-1]
        jobs += [(label, r, {**common, **jobs_by_config[label]}) for label in order]
    print(f"{len(jobs)} engines: {', '.join(CONFIGS)} x {args.rounds} rounds, loads {loads}, "
          f"{len(chats)} prompts x {args.max_tokens} tokens, greedy", flush=True)
    from peagle.engine.settings import EngineSettings

    t = time.perf_counter()
    raw = run_in_subprocess([j for _, _, j in jobs], timeout=None,
                            settings=EngineSettings.model_validate(engine_cfg))
    print(f"measured in {time.perf_counter() - t:.0f} s", flush=True)
    timings, steps, served = [], [], {}
    for (label, r, _), res in zip(jobs, raw):
        timings += timings_of(label, r, res["ladder"])
        steps += steps_of(label, r, res.get("step_costs"))
        served[label] = res.get("speculative_config")
    table = build_table(timings, max_tokens=args.max_tokens, prompts=len(chats), steps=steps)
    accepted: dict[str, list] = {}
    for (label, _, _), res in zip(jobs, raw):
        sd = res.get("spec_decode") or {}
        acc = accepted.setdefault(label, [0, 0])
        acc[0], acc[1] = acc[0] + sd.get("drafts", 0), acc[1] + sd.get("accepted_tokens", 0)
    for label in CONFIGS[1:]:
        drafts, acc = accepted.get(label, [0, 0])
        al = f"acceptance length {1 + acc / drafts:.3f} over {drafts} drafts" if drafts else "no drafts"
        print(f"  {label}: {al}; vLLM served {json.dumps(served[label])}")

    rows = []
    for c in loads:
        for label in CONFIGS:
            p = table.point(label, c)
            r = p.speedup
            rows.append([c, label, f"{p.tokens_per_s:.1f}", "1" if r is None else
                         f"{r.value:.2f} [{r.low:.2f}-{r.high:.2f}]", f"{p.tpot_s.p50 * 1e3:.1f}",
                         "-" if p.step is None else f"{p.step.step_s * 1e3:.1f}",
                         "-" if p.step is None else f"{p.step.draft_s * 1e3:.1f}",
                         "-" if p.step is None else f"{p.step.tokens_per_step:.2f}"])
    print()
    print(format_table(["in flight", "configuration", "tokens/s", "x target alone [95%]", "TPOT p50 ms",
                        "step ms", "draft ms/step", "tokens/step"], rows))
    (work / "table.json").write_text(table.model_dump_json(indent=1))
    print(f"\ntable: {work / 'table.json'}")


if __name__ == "__main__":
    main()
