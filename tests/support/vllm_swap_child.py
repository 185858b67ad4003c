"""Child interpreter of the draft-swap tests: one real vLLM engine (in-process) serving ``target`` + ``draft``
with the ``peagle-draft`` weight-transfer engine, driven through a list of steps; prints the results.

Job (JSON on stdin): ``target``, ``draft``, ``k``, ``prompts`` (token-id lists), ``max_tokens``, ``steps``:
``{"generate": true}`` (greedy; the step's token ids and spec-decode counts, the counters' difference),
``{"swap": uri, "fingerprint": "..."}`` (start_draft_weight_update -> update_weights -> finish; the error text
when it raises), ``{"swap": uri, "fail_load": true}`` (the same, with the first load into the model made to
raise half-way: the transactional path). Every step also reports the fingerprint the worker serves.
Run with ``python -m support.vllm_swap_child`` (tests/ on the path).
"""
from __future__ import annotations

import json
import sys


def main() -> None:
    job = json.loads(sys.stdin.read())
    from peagle.engine import child, llm as engine
    from peagle.engine.settings import EngineSettings
    from peagle.evaluate.vllm_job import spec_decode_counts
    from peagle.swap import engine as swap
    from vllm import SamplingParams, TokensPrompt

    settings = EngineSettings(in_process=True)
    kwargs = engine.engine_kwargs(settings, job["target"], seed=0, log_stats=True, dtype="float32",
                                  speculative_config={"method": "eagle3", "model": job["draft"],
                                                      "num_speculative_tokens": int(job["k"]),
                                                      "parallel_drafting": True},
                                  weight_transfer_config={"backend": swap.BACKEND})
    llm = engine.build_llm(kwargs, settings)
    params = SamplingParams(max_tokens=int(job["max_tokens"]), temperature=0.0, ignore_eos=True)
    before = spec_decode_counts(llm.get_metrics())
    results = []
    for step in job["steps"]:
        out: dict = {}
        if step.get("generate"):
            outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in job["prompts"]], params, use_tqdm=False)
            now = spec_decode_counts(llm.get_metrics())
            out["token_ids"] = [list(o.outputs[0].token_ids) for o in outs]
            out["spec_decode"] = {key: ([a - b for a, b in zip(now[key], before[key])] if isinstance(now[key], list)
                                        else now[key] - before[key]) for key in now}
            before = now
        else:
            original = swap.PublishedDraftEngine._load
            if step.get("fail_load"):
                calls = []

                class HalfThenFail(dict):
                    def items(self):  # what the model's load_weights reads: half the tensors, then an error
                        listed = list(super().items())
                        yield from listed[: len(listed) // 2]
                        raise RuntimeError("injected failure while loading")

                def failing(self, tensors, calls=calls, original=original):
                    calls.append(1)  # the first load (the new draft's) fails; the load back of the old one runs
                    return original(self, HalfThenFail(tensors) if len(calls) == 1 else tensors)

                swap.PublishedDraftEngine._load = failing
            try:
                llm.start_draft_weight_update()
                # a failed update ends the worker's session itself: finish only after a success
                llm.update_weights({"update_info": {"uri": step["swap"], "fingerprint": step.get("fingerprint", "")}})
                llm.finish_weight_update()
                out["swapped"] = True
            except Exception as exc:  # noqa: BLE001 - the test reads the refusal's text
                out["swapped"], out["error"] = False, f"{type(exc).__name__}: {exc}"
            finally:
                swap.PublishedDraftEngine._load = original
        out["fingerprint"] = llm.collective_rpc(swap.worker_fingerprint)[0]
        results.append(out)
    engine.shutdown(llm)
    child.print_result(results)


if __name__ == "__main__":
    main()
