"""The refresh: a window of captured traffic into a candidate draft, gated against the serving draft.

It runs the stages (prepare, extract, train) around the traffic log (:mod:`peagle.traffic`), so it
lives outside :mod:`peagle.traffic`: the serving side imports none of this, and no stage imports the
refresh. It reads a run configuration through :class:`.sections.RefreshRunConfig` and never imports the
assembly (:mod:`peagle.run_config`).

* :mod:`.sections` -- what the refresh reads of a run configuration;
* :mod:`.selection` -- cleaning and the time split of the captured records;
* :mod:`.trigger` -- whether a (scheduled) refresh is needed;
* :mod:`.steps` -- the steps (select, prepare + replay, extract, train warm-started, gate, lineage) and
  ``refresh()`` running them in order; ``peagle refresh`` is :mod:`peagle.commands.refresh`.
"""
