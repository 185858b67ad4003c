"""Served traffic: capture the requests a vLLM server answers, serve locally, replay prompts.

* :mod:`.settings` -- capture (serving side, from ``PEAGLE_CAPTURE_*``) and refresh settings;
* :mod:`.redact`, :mod:`.log`, :mod:`.middleware` -- what the vLLM server loads when capture is on (light
  imports only: no torch, no vLLM); the record itself is :mod:`peagle.records.traffic`;
* :mod:`.serve`, :mod:`.replay` -- the local serving stack and a traffic replayer.

The refresh (a traffic window into a candidate draft) is :mod:`peagle.refresh`; the gate that decides whether
the candidate counts is :mod:`peagle.gate`.
"""
