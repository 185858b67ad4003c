"""Talking HTTP, below every package that does: standard library and :mod:`peagle.errors` only.

* :mod:`.json_client` -- the one JSON-over-HTTP request (``urllib``): method, bearer token, JSON body,
  timeout, TLS verification, redirect policy, and one error type (:class:`~.json_client.HttpError`)
  carrying the status and the URL without credentials. :mod:`peagle.engine.client` (the OpenAI-compatible
  client) and :mod:`peagle.rollout.registry` (the Model Registry client) build on it;
* :mod:`.sse` -- the one parser of an OpenAI-style streamed answer (server-sent ``data:`` chunks): the
  client that reads a stream and the capture middleware that copied one (inside vLLM's API server) both
  use it.

This ``__init__`` imports nothing, so importing a submodule stays light.
"""
