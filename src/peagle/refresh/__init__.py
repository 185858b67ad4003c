"""The refresh: a window of captured traffic into a candidate draft, gated against the serving draft.

It assembles the stages (prepare, extract, train from :mod:`peagle.run_config`) around the traffic
log (:mod:`peagle.traffic`), so it lives outside :mod:`peagle.traffic`: the serving side imports none
of this, and no stage imports the refresh.

* :mod:`.selection` -- cleaning and the time split of the captured records;
* :mod:`.steps` -- the steps (select, prepare + replay, extract, train warm-started, gate, lineage),
  ``refresh()`` running them in order and ``peagle refresh``.
"""
