"""``peagle run``'s arguments for the embedded pipeline (src/peagle/pipeline/local/job.py)."""
from __future__ import annotations

import yaml

from peagle.pipeline.params import PipelineParams, resolve_run


def test_peagle_run_keeps_prepare_when_only_regeneration_is_set():
    from peagle.pipeline.local import embedded
    from peagle.pipeline.local.job import pipeline_arguments, user_settings

    args = pipeline_arguments(user_settings(None, ["regenerate.max_conversations=1900"]))
    assert args["num_samples"] == embedded.PARAMS["num_samples"]
    assert yaml.safe_load(args["config"])["regenerate"]["max_conversations"] == 1900
    run = resolve_run(PipelineParams(**{k: args[k] for k in PipelineParams.model_fields if k in args}),
                      args["config"], "/tmp/r")
    assert (run.config.prepare.max_samples, run.config.regenerate.max_conversations) == (
        embedded.PARAMS["num_samples"], 1900)
