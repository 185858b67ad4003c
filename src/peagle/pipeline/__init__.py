"""The Kubeflow pipeline around the stages: library logic of its components, the TrainJob launcher,
the cluster profile, compilation/submission and the kfp.local runner (``peagle pipeline``).

* :mod:`.layout`      -- one object-store prefix per run, fixed sub-prefixes per stage
* :mod:`.params`      -- typed pipeline parameters + config YAML -> the validated run settings
* :mod:`.steps`       -- init_run, regenerate, prepare, extract
* :mod:`.training`    -- train in the pod (:mod:`.train_worker`) or through a TrainJob (:mod:`.trainjob`)
* :mod:`.evaluation`  -- vLLM-measured acceptance and the deploy gate
* :mod:`.deployment`  -- serve (or render) target + draft
* :mod:`.refresh_params`, :mod:`.refresh_steps` -- the traffic refresh pipeline's parameters and
  components (``pipelines/peagle_refresh.py``), around :mod:`peagle.refresh.steps`
* :mod:`.profile`     -- the cluster profile applied at compile time
* :mod:`.build`       -- find ``pipelines/`` + ``components/``, compile
* :mod:`.submit`      -- kfp.Client submission
* :mod:`.local`       -- the main job, ``peagle run``: the same pipeline under kfp.local on the embedded
  default (``local.job``: its flags and settings; ``local.runner``: kfp.local with a progress display;
  ``local.embedded``: SmolLM2 + ShareGPT on CPU)
* :mod:`.seaweed`     -- a throw-away SeaweedFS S3 server for ``run --s3``
* :mod:`.objects`, :mod:`.progress` -- object-store helpers; stage timing events
"""
