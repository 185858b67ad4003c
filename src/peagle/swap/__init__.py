"""Swapping the draft inside a running vLLM server (issue #41): no restart, the target never reloaded.

* :mod:`.checks` -- whether a published draft may replace the running one: the same shape of draft (its
  config's structure, every tensor's name, shape and kind), the same vocabulary maps, finite weights. Pure;
  no vLLM.
* :mod:`.engine` -- :class:`~.engine.PublishedDraftEngine`, a vLLM weight-transfer engine (backend
  ``peagle-draft``) that loads a published draft (local path or ``s3://``) into the worker's draft model,
  between engine steps, all or nothing. The project's vLLM plugin registers it in every vLLM process.
"""
