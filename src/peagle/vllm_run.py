"""Run real vLLM offline on a target, with or without a P-EAGLE draft, and read its spec-decode counters.

vLLM starts worker processes with spawn and holds a lot of memory, so callers run it in a child
process: ``run_in_subprocess(job)`` executes ``python -m peagle.vllm_run`` with a JSON job and returns
its JSON result. The same module is the engine-side entry for the evaluation stage later.

Job keys: ``model`` (target dir, or a draft dir for the short form), ``draft`` (optional draft dir,
long form), ``num_speculative_tokens``, ``prompts`` (list of chat message lists or strings),
``max_tokens``, ``temperature``, ``max_model_len``, ``dtype``, ``seed``.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

SPEC_COUNTERS = (
    "vllm:spec_decode_num_drafts",
    "vllm:spec_decode_num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens",
)
SPEC_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


def spec_decode_counts(metrics) -> dict[str, Any]:
    """Spec-decode counters from ``LLM.get_metrics()`` objects, summed over label sets."""
    out: dict[str, Any] = {"drafts": 0, "draft_tokens": 0, "accepted_tokens": 0, "accepted_per_pos": []}
    keys = dict(zip(SPEC_COUNTERS, ("drafts", "draft_tokens", "accepted_tokens")))
    for m in metrics:
        name = getattr(m, "name", "")
        if name in keys:
            out[keys[name]] += int(getattr(m, "value", 0))
        elif name == SPEC_PER_POS:
            vals = [int(v) for v in getattr(m, "values", [])]
            acc = out["accepted_per_pos"]
            if len(acc) < len(vals):
                acc.extend([0] * (len(vals) - len(acc)))
            for i, v in enumerate(vals):
                acc[i] += v
    return out


def _run(job: dict[str, Any]) -> dict[str, Any]:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(job.get("kv_cache_gib", 1)))
    from vllm import LLM, SamplingParams

    kwargs: dict[str, Any] = dict(
        model=job["model"],
        dtype=job.get("dtype", "bfloat16"),
        max_model_len=int(job.get("max_model_len", 1024)),
        enforce_eager=True,
        seed=int(job.get("seed", 0)),
        disable_log_stats=False,
        trust_remote_code=False,
        max_num_seqs=int(job.get("max_num_seqs", 16)),
    )
    if job.get("draft"):
        kwargs["speculative_config"] = {
            "method": "eagle3",
            "model": job["draft"],
            "num_speculative_tokens": int(job["num_speculative_tokens"]),
            "parallel_drafting": True,
        }
    llm = LLM(**kwargs)
    params = SamplingParams(
        max_tokens=int(job.get("max_tokens", 32)),
        temperature=float(job.get("temperature", 0.0)),
        seed=int(job.get("seed", 0)),
        ignore_eos=bool(job.get("ignore_eos", False)),
    )
    prompts = job["prompts"]
    if prompts and isinstance(prompts[0], list):
        outs = llm.chat(prompts, params, use_tqdm=False)
    else:
        outs = llm.generate(prompts, params, use_tqdm=False)
    result = {
        "texts": [o.outputs[0].text for o in outs],
        "token_ids": [list(o.outputs[0].token_ids) for o in outs],
        "spec_decode": spec_decode_counts(llm.get_metrics()),
        "speculative_config": _spec_config_of(llm),
    }
    _shutdown(llm)
    return result


def _shutdown(llm) -> None:
    # Free the engine (and its worker processes) before the next job in the same interpreter.
    import gc

    engine_core = getattr(llm.llm_engine, "engine_core", None)
    if engine_core is not None and hasattr(engine_core, "shutdown"):
        engine_core.shutdown()
    del llm
    gc.collect()


def _spec_config_of(llm) -> dict[str, Any] | None:
    sc = llm.llm_engine.vllm_config.speculative_config
    if sc is None:
        return None
    return {"method": sc.method, "num_speculative_tokens": sc.num_speculative_tokens,
            "parallel_drafting": bool(getattr(sc, "parallel_drafting", False)), "model": sc.model}


def run_in_subprocess(job: dict[str, Any] | list[dict[str, Any]], timeout: float = 1200):
    """Run one vLLM job (or a list, sequentially, sharing the interpreter's start-up) in a fresh
    interpreter; returns the result (or list of results). Raises with vLLM's own error text on failure."""
    proc = subprocess.run(
        [sys.executable, "-m", "peagle.vllm_run"], input=json.dumps(job), capture_output=True, text=True,
        timeout=timeout, env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"},
    )
    marker = "PEAGLE_RESULT "
    for line in proc.stdout.splitlines():
        if line.startswith(marker):
            return json.loads(line[len(marker):])
    tail = "\n".join((proc.stderr or "").splitlines()[-40:])
    raise RuntimeError(f"vLLM job failed (exit {proc.returncode}):\n{tail}")


def main() -> None:
    job = json.loads(sys.stdin.read())
    result = [_run(j) for j in job] if isinstance(job, list) else _run(job)
    print("PEAGLE_RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
