"""The main job (``peagle run``): the Kubeflow pipeline on this machine under kfp.local.

* :mod:`.job`      -- its flags (one parser for ``peagle run`` and ``peagle pipeline run``), the
  embedded run's pipeline arguments with the user's settings applied, and the run itself
* :mod:`.runner`   -- any pipeline arguments under kfp.local, with the progress display and timings
* :mod:`.embedded` -- the embedded default: SmolLM2-135M-Instruct + a ShareGPT subset on 2 CPU cores
"""
