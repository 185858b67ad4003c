"""The gate: a candidate draft against the serving draft on the same prompts, paired, with intervals.

* :mod:`.run` -- the measurement (both drafts served by vLLM at one K; the traffic and general prompt sets;
  the float32 losslessness check; speed at the deployed load) and the verdict;
* :mod:`.report` -- the result: typed figures, ``gate.json`` (``peagle.traffic.gate/v1``), ``gate.html``, KFP metrics;
* :mod:`.settings` -- the ``gate`` section.

``peagle gate`` is :mod:`peagle.commands.gate`; the refresh runs the gate as its last step.
"""
