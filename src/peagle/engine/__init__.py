"""Where peagle meets vLLM and HTTP: one home for each.

* :mod:`.llm`    -- offline ``vllm.LLM`` engines: the arguments every engine shares, the environment
  vLLM reads when one is built (CPU KV cache, in-process mode, OpenMP threads) and shutdown;
* :mod:`.child`  -- the one child-process runner (vLLM engines run in fresh interpreters): timeout,
  process-group kill, progress relay, log tail in the error;
* :mod:`.client` -- the one OpenAI-compatible HTTP client (chat, models, ``/metrics`` text) with
  bounded retries and backoff, used by regeneration, endpoint evaluation and the deploy smoke test.

The package is not named ``vllm`` on purpose: ``import vllm`` anywhere in peagle means the real one.
"""
