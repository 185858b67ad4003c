"""The refresh pipeline: trigger -> [select -> prepare (+ replay) -> extract -> train (warm start) -> gate
-> [rollout]].

Turns a window of captured traffic into a candidate draft, gates it against the serving draft and, when
``rollout_routing`` is not ``none``, rolls it out; the same steps as ``peagle refresh``
(:mod:`peagle.refresh.steps`); see docs/traffic.md. Built for a cluster profile like the default pipeline
(``peagle_pipeline.py``): the same images by role, the same data connection mounted as files in every
step, no caching, the profile's retries, and each step takes the resources and deadline of the default
pipeline's stage doing that work (``components/refresh.py``: ``PROFILE_STEP``; the trigger and the rollout
their own steps, ``trigger`` and ``rollout``); train runs on one GPU of the pool.

* The first step, ``refresh_trigger``, validates every setting before any GPU step (the rollout settings
  against the rollout step's deadline too: the profile's, in ``PEAGLE_ROLLOUT_DEADLINE_S``), writes ``run.json``
  and decides whether a refresh is needed (:mod:`peagle.refresh.trigger`: enough new traffic, or live
  acceptance fell); ``trigger.json`` and the run's metrics say why. Not needed: every other step sits in
  ``dsl.If(go)`` and is skipped, and the run ends green -- what a recurring run does most of the time.
* Stages exchange the refresh URI (``<output_root>/<run_name or job id>``); the data stays in the
  object store under it, and each stage declares what it published as a lineage artifact.
* The gate's verdict is its output (``True``: the candidate beat the serving draft); its figures go to
  the run's metrics and its page to an HTML artifact. A rejection is a verdict, not a failed run.
  ``refresh_rollout`` runs only under ``dsl.If(passed)``: canary beside the stable deployment
  (``deploy_name``/``deploy_namespace``/``deploy_mode``), decision on live acceptance, promotion or rollback.
* Retries of the tasks inside the conditions need a backend with kubeflow/pipelines #11908 (OpenShift AI
  2.22's build carries it); an older 2.5 backend runs them once (tests/support/kfp_features.py: ``NESTED_RETRY``,
  reported, not required).
* The parameters are defined once, in ``peagle.pipeline.refresh_params``.
"""
from types import SimpleNamespace

from kfp import dsl, kubernetes

from components import refresh
from peagle.pipeline.params import pipeline_docstring, pipeline_signature
from peagle.pipeline.profile import IN_PROCESS_RETRY, ClusterProfile, apply_step
from peagle.pipeline.refresh_params import REFRESH_MODELS, ROLLOUT_DEADLINE_ENV, refresh_parameters
from peagle.rollout.settings import RolloutSettings

SWAP_TOKEN_ENV = RolloutSettings().swap_token_env  # where the rollout step finds the swap endpoint's token

PIPELINE_NAME = "peagle-refresh"
DESCRIPTION = ("Refresh a served P-EAGLE draft from the traffic it served, when needed (enough new traffic, or "
               "live acceptance fell): select a window of captured requests, train a candidate warm-started from "
               "the serving draft (with replay of its own training data), gate it against the serving draft with "
               "real vLLM on the newest traffic, and optionally roll it out (canary, promote or roll back on live "
               "acceptance).")
TRAIN_GPUS = 1  # a refresh fine-tunes on a traffic window: one GPU of the pool


def build_pipeline(profile: ClusterProfile):
    """The refresh pipeline function for ``profile`` (compile it)."""
    c = refresh.build(profile)
    swap_secret = profile.swap_token_secret()
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

        trig = step(c.refresh_trigger(output_root=p.output_root, run_name=p.run_name,
                                      job_id=dsl.PIPELINE_JOB_ID_PLACEHOLDER, config=p.config,
                                      data_connection=p.data_connection,
                                      **{name: getattr(p, name) for name in refresh_parameters()}),
                    "refresh_trigger", "trigger: refresh needed?")
        # the rollout step's deadline, which the run's rollout settings must fit (checked by the trigger)
        trig.set_env_variable(ROLLOUT_DEADLINE_ENV, str(profile.step("rollout").timeout_s))
        uri = trig.outputs["refresh_uri"]
        with dsl.If(trig.outputs["go"] == True, name="refresh-needed"):  # noqa: E712
            sel = step(c.refresh_select(refresh_uri=uri), "refresh_select", "select traffic")
            prep = step(c.refresh_prepare(refresh_uri=uri).after(sel), "refresh_prepare", "prepare rows (+ replay)")
            ext = step(c.refresh_extract(refresh_uri=uri).after(prep), "refresh_extract", "extract hidden states")
            train = step(c.refresh_train(refresh_uri=uri).after(ext), "refresh_train", "train candidate (warm start)",
                         gpus=TRAIN_GPUS)
            gate = step(c.refresh_gate(refresh_uri=uri, candidate_uri=train.outputs["Output"]), "refresh_gate",
                        "gate (vLLM, paired)")
            with dsl.If(gate.outputs["Output"] == True, name="gate-passed"):  # noqa: E712
                roll = step(c.refresh_rollout(refresh_uri=uri, candidate_uri=train.outputs["Output"],
                                              rollout_routing=p.rollout_routing, deploy_name=p.deploy_name,
                                              deploy_namespace=p.deploy_namespace, deploy_mode=p.deploy_mode,
                                              data_connection=p.data_connection, serving=profile.serving_json()),
                            "refresh_rollout", "roll out (canary, live decision)")
                if swap_secret is not None:  # the stable serves the swap endpoint: promotion swaps, with its token
                    kubernetes.use_secret_as_env(roll, secret_name=swap_secret[0],
                                                 secret_key_to_env={swap_secret[1]: SWAP_TOKEN_ENV})

    peagle_refresh.__signature__ = signature
    peagle_refresh.__doc__ = pipeline_docstring(DESCRIPTION, REFRESH_MODELS)
    return dsl.pipeline(name=PIPELINE_NAME, description=DESCRIPTION)(peagle_refresh)
