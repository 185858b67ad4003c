"""Child process for test_vllm_amx: vLLM with its default spawned engine/worker process on one target.

Prints ``PROBE {json}``: the greedy outputs, what peagle's vLLM plugin did in this (front-end) process
and in every worker (``LLM.collective_rpc``), and the attention ISA vLLM picks for the target's shape.
"""
from __future__ import annotations

import json
import os
import sys


def _worker_isa(worker, head_size: int) -> str:
    import torch
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    return _get_attn_isa(torch.bfloat16, block_size=128, head_size=head_size)


def main() -> None:
    target, head_size = sys.argv[1], int(sys.argv[2])
    # Callables travel to the workers only with this set (vLLM pickles them); tests only.
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams

    from peagle import vllm_plugin

    llm = LLM(model=target, dtype="bfloat16", max_model_len=256, enforce_eager=True, seed=0,
              max_num_seqs=4, trust_remote_code=False)
    outs = llm.generate(["def main(", "import os\nimport", "class A:"],
                        SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True), use_tqdm=False)
    workers = llm.collective_rpc(vllm_plugin.worker_report)
    isa = llm.collective_rpc(_worker_isa, args=(head_size,))
    print("PROBE " + json.dumps({
        "front_end": {**vllm_plugin.worker_report(), "pid": os.getpid()},
        "workers": workers,
        "attn_isa": isa,
        "generated": [len(o.outputs[0].token_ids) for o in outs],
    }), flush=True)
    llm.llm_engine.engine_core.shutdown()


if __name__ == "__main__":
    main()
