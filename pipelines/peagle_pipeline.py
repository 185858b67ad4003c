"""The peagle pipeline: init_run -> (regenerate) -> prepare -> extract x N -> train -> evaluate -> [gate] deploy.

Built for a cluster profile (``peagle.pipeline.profile``), which fixes images, the GPU pool, step
resources, retries and the TrainJob/serving settings at compile time; everything about one run is
a pipeline parameter. Compile with ``peagle pipeline compile``; the same function runs
locally under kfp.local (``peagle pipeline run``, ``peagle run``).

Control flow, and why it has this shape:

* ``regenerate`` is optional. Stages exchange the run URI, and a task cannot depend on a task
  inside a condition, so init_run sits in both branches of If/Else and ``dsl.OneOf`` picks the URI
  of the branch that ran.
* Extraction fans out with ``dsl.ParallelFor`` over prepare's shard assignments (its list
  output; loop bodies cannot read ``OneOf`` values locally, so each assignment carries the run URI
  itself). Train fans in through the object
  store: it runs ``.after()`` the whole loop and reads the published shard sets (their manifest is
  written by the last worker). ``dsl.Collected`` would do the same through KFP, but needs a newer
  upstream backend than KFP 2.5.0, the declared minimum (see ``peagle.support``). With the
  profile's ``train_beside_extract`` (for ``train.data_mode=streaming``), train runs ``.after()``
  prepare only: it starts beside the workers and reads each shard set as it is published.
* Retries: the profile's policy is each step's KFP retry, except extract's: KFP ignores the retry policy
  of a task inside a ParallelFor (kubeflow/pipelines #12389, #13897), so extract makes its attempts in
  its own process (its shard sets are resumable).
* Training runs either in its own pod (``torchrun``, accelerator limit = ``num_gpus``) or as a
  Kubeflow Trainer TrainJob created and watched by a light launcher pod that holds no GPU.
* Deploy runs only when evaluate's gate verdict is True.
* Lineage: every stage also declares what it published as an output artifact (a pointer whose
  metadata names the object-store prefix, its manifest's sha256 and counts; ``peagle.pipeline.lineage``),
  so the dashboard shows what each run wrote; no data passes through KFP.
* The parameters (names, types, defaults, descriptions) are defined once, in
  ``peagle.pipeline.params``; the pipeline function takes its signature and docstring from there.
"""
from types import SimpleNamespace

from kfp import dsl

import components
from peagle.pipeline.params import init_run_parameters, pipeline_docstring, pipeline_signature
from peagle.pipeline.profile import ClusterProfile, apply_step

PIPELINE_NAME = "peagle"
DESCRIPTION = ("Train a P-EAGLE speculative-decoding draft for a target LLM from its own hidden states, "
               "measure it with vLLM and serve target + draft with KServe when it clears the acceptance gate.")


def build_pipeline(profile: ClusterProfile):
    """The pipeline function for ``profile`` (compile it, or call it under kfp.local)."""
    c = components.build(profile)

    signature = pipeline_signature()

    def peagle(*args):
        # KFP calls the pipeline function with one channel per parameter, in signature order.
        p = SimpleNamespace(**dict(zip(signature.parameters, args)))
        data_connection, num_gpus, num_speculative_tokens = p.data_connection, p.num_gpus, p.num_speculative_tokens
        init_args = dict(output_root=p.output_root, run_name=p.run_name, job_id=dsl.PIPELINE_JOB_ID_PLACEHOLDER,
                         config=p.config, data_connection=data_connection,
                         train_beside_extract=profile.train_beside_extract,
                         **{name: getattr(p, name) for name in init_run_parameters()})

        def step(task, name, display, gpus=None):
            return apply_step(task, name, profile, data_connection, gpus=gpus, display_name=display)

        with dsl.If(p.regenerate == True, name="regenerate-data"):  # noqa: E712 (KFP condition, not Python)
            init_r = step(c.init_run(**init_args), "init_run", "init run")
            regen = step(c.regenerate(run_uri=init_r.outputs["Output"]), "regenerate", "regenerate responses")
        with dsl.Else(name="data-as-is"):
            init_p = step(c.init_run(**init_args), "init_run", "init run")
        run_uri = dsl.OneOf(regen.outputs["Output"], init_p.outputs["Output"])

        prep = step(c.prepare(run_uri=run_uri), "prepare", "prepare data")
        # (unnamed: a named ParallelFor breaks dsl.Collected in the KFP 2.17 compiler)
        with dsl.ParallelFor(prep.outputs["Output"], parallelism=profile.extract_parallelism or None) as shard:
            # retried in its own process: KFP ignores the retry policy of a task inside a ParallelFor
            ext = step(c.extract(shard=shard, retry=profile.retry.model_dump_json()), "extract",
                       "extract hidden states")
        # Train after the whole loop, or (streaming runs) beside it, as soon as the prepared rows exist.
        data_ready = prep if profile.train_beside_extract else ext

        # num_gpus is also a plain input of train: that makes the compiler pass it into the branch, where
        # the pod's accelerator limit reads it.
        train_args = dict(run_uri=run_uri, num_gpus=num_gpus, cluster=profile.trainjob_json(),
                          data_connection=data_connection, job_id=dsl.PIPELINE_JOB_ID_PLACEHOLDER)
        with dsl.If(p.train_mode == "trainjob", name="train-with-trainjob"):
            train_tj = step(c.train_launcher(mode="trainjob", **train_args).after(data_ready),
                            "train_launcher", "train (TrainJob)")
        with dsl.Else(name="train-in-pod"):
            limit = step(c.gpu_limit(num_gpus=num_gpus), "gpu_limit", "GPU limit")
            # .after(limit): the compiler does not make the limit's producer a dependency by itself
            train_pod = step(c.train(mode="pod", **train_args).after(data_ready, limit), "train", "train (torchrun)",
                             gpus=limit.output)
        draft_uri = dsl.OneOf(train_tj.outputs["Output"], train_pod.outputs["Output"])

        ev = step(c.evaluate(run_uri=run_uri, draft_uri=draft_uri), "evaluate", "evaluate (vLLM)")
        with dsl.If(ev.outputs["Output"] == True, name="acceptance-gate"):  # noqa: E712
            step(c.deploy(run_uri=run_uri, name=p.deploy_name, mode=p.deploy_mode, data_connection=data_connection,
                          num_speculative_tokens=num_speculative_tokens, serving=profile.serving_json()),
                 "deploy", "deploy (KServe)")

    peagle.__signature__ = signature
    peagle.__doc__ = pipeline_docstring(DESCRIPTION)
    return dsl.pipeline(name=PIPELINE_NAME, description=DESCRIPTION)(peagle)
