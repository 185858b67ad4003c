"""Where peagle meets vLLM and HTTP: one home for each.

* :mod:`.settings` -- :class:`~.settings.EngineSettings`, the ``engine`` sub-section of regenerate,
  extract and evaluate (one meaning per key; a stage's own defaults where it differs on purpose);
* :mod:`.llm`    -- offline ``vllm.LLM`` engines: their arguments from those settings (every default
  decided in ``engine_kwargs``), the environment vLLM reads when one is built (CPU KV cache,
  in-process mode, OpenMP threads) and shutdown;
* :mod:`.child`  -- the one child-process runner (vLLM engines run in fresh interpreters): timeout,
  process-group kill, progress relay, log tail in the error, one result and one error marker;
* :mod:`.metering` -- vLLM's progress (finished requests, generated tokens) fed to a
  :mod:`peagle.progress` reporter through ``LLM.generate``'s ``use_tqdm`` hook;
* :mod:`.client` -- the one OpenAI-compatible HTTP client (chat, models, ``/metrics`` text) with
  bounded retries and backoff, used by regeneration, endpoint evaluation and the deploy smoke test.

The package is not named ``vllm`` on purpose: ``import vllm`` anywhere in peagle means the real one.
"""
