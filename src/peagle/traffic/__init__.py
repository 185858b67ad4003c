"""Drafts that follow the traffic they serve: capture served requests, refresh the draft, gate it.

* :mod:`.settings` -- capture (serving side, from ``PEAGLE_CAPTURE_*``), refresh and gate settings;
* :mod:`.record`, :mod:`.redact`, :mod:`.log`, :mod:`.middleware` -- what the vLLM server loads when
  capture is on (light imports only: no torch, no vLLM);
* :mod:`.serve`, :mod:`.replay` -- the local serving stack and a traffic replayer;
* :mod:`.selection`, :mod:`.refresh` -- a traffic window into a candidate draft;
* :mod:`.gate` -- the paired comparison that decides whether the candidate counts.
"""
