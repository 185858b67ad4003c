"""The refresh pipeline: select -> prepare (+ replay) -> extract -> train (warm start) -> gate.

Turns a window of captured traffic into a candidate draft and gates it against the serving draft,
the same steps as ``peagle refresh`` (:mod:`peagle.refresh.steps`); see docs/traffic.md. Built for
a cluster profile like the default pipeline (``peagle_pipeline.py``): the same images by role, the
same data connection mounted as files in every step, no caching, the profile's retries, and each
step takes the resources and deadline of the default pipeline's stage doing that work
(``components/refresh.py``: ``PROFILE_STEP``); train runs on one GPU of the pool.

* Stages exchange the refresh URI (``<output_root>/<run_name or job id>``); the data stays in the
  object store under it, and each stage declares what it published as a lineage artifact. select validates every setting first, before any
  GPU step starts.
* No loop and no condition: every task sits in the root DAG, so the profile's retries hold on a
  Kubeflow Pipelines 2.5 backend (tests/kfp_features.py), extract's included.
* The gate's verdict is the last step's output (``True``: the candidate beat the serving draft); its
  figures go to the run's metrics and its page to an HTML artifact. A rejection is a verdict, not a
  failed run. Rolling the candidate out is not part of this pipeline.
* The parameters are defined once, in ``peagle.pipeline.refresh_params``.
"""
from types import SimpleNamespace

from kfp import dsl

from components import refresh
from peagle.pipeline.params import pipeline_docstring, pipeline_signature
from peagle.pipeline.profile import IN_PROCESS_RETRY, ClusterProfile, apply_step
from peagle.pipeline.refresh_params import REFRESH_MODELS, refresh_parameters

PIPELINE_NAME = "peagle-refresh"
DESCRIPTION = ("Refresh a served P-EAGLE draft from the traffic it served: select a window of captured "
               "requests, train a candidate warm-started from the serving draft (with replay of its own "
               "training data), and gate it against the serving draft with real vLLM on the newest traffic.")
TRAIN_GPUS = 1  # a refresh fine-tunes on a traffic window: one GPU of the pool


def build_pipeline(profile: ClusterProfile):
    """The refresh pipeline function for ``profile`` (compile it)."""
    c = refresh.build(profile)
    signature = pipeline_signature(REFRESH_MODELS)

    def peagle_refresh(*args):
        # KFP calls the pipeline function with one channel per parameter, in signature order.
        p = SimpleNamespace(**dict(zip(signature.parameters, args)))

        def step(task, component, display, gpus=None):
            name = refresh.PROFILE_STEP[component]
            apply_step(task, name, profile, p.data_connection, gpus=gpus, display_name=display)
            if name in IN_PROCESS_RETRY and profile.retry.num_retries:
                # outside a ParallelFor KFP honours the retry the default pipeline's extract makes in-process
                task.set_retry(**profile.retry.model_dump())
            return task

        sel = step(c.refresh_select(output_root=p.output_root, run_name=p.run_name,
                                    job_id=dsl.PIPELINE_JOB_ID_PLACEHOLDER, config=p.config,
                                    data_connection=p.data_connection,
                                    **{name: getattr(p, name) for name in refresh_parameters()}),
                   "refresh_select", "select traffic")
        uri = sel.outputs["Output"]
        prep = step(c.refresh_prepare(refresh_uri=uri), "refresh_prepare", "prepare rows (+ replay)")
        ext = step(c.refresh_extract(refresh_uri=uri).after(prep), "refresh_extract", "extract hidden states")
        train = step(c.refresh_train(refresh_uri=uri).after(ext), "refresh_train", "train candidate (warm start)",
                     gpus=TRAIN_GPUS)
        step(c.refresh_gate(refresh_uri=uri, candidate_uri=train.outputs["Output"]), "refresh_gate",
             "gate (vLLM, paired)")

    peagle_refresh.__signature__ = signature
    peagle_refresh.__doc__ = pipeline_docstring(DESCRIPTION, REFRESH_MODELS)
    return dsl.pipeline(name=PIPELINE_NAME, description=DESCRIPTION)(peagle_refresh)
