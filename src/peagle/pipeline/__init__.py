"""The Kubeflow pipeline around the stages: library logic of its components, the TrainJob launcher,
the cluster profile, compilation/submission and the kfp.local runner (``python -m peagle.pipeline``).

* :mod:`.layout`      -- one object-store prefix per run, fixed sub-prefixes per stage
* :mod:`.params`      -- typed pipeline parameters + config YAML -> the validated run settings
* :mod:`.steps`       -- init_run, regenerate, prepare, extract
* :mod:`.training`    -- train in the pod (:mod:`.train_worker`) or through a TrainJob (:mod:`.trainjob`)
* :mod:`.evaluation`  -- vLLM-measured acceptance and the deploy gate
* :mod:`.deployment`  -- serve (or render) target + draft
* :mod:`.profile`     -- the cluster profile applied at compile time
* :mod:`.build`       -- find ``pipelines/`` + ``components/``, compile
* :mod:`.submit`      -- kfp.Client submission
* :mod:`.local_runner` -- the same pipeline under kfp.local, with a progress display
* :mod:`.embedded`    -- the embedded default ``peagle run`` uses (SmolLM2 + ShareGPT on CPU)
* :mod:`.seaweed`     -- a throw-away SeaweedFS S3 server for ``run --s3``
* :mod:`.objects`, :mod:`.progress` -- object-store helpers; stage timing events
"""
