"""The refresh pipeline's components: trigger -> select -> prepare (+ replay) -> extract -> train (warm start)
-> gate -> rollout.

Each function only imports and calls ``peagle.pipeline.refresh_steps`` (which calls the steps of
``peagle refresh``, :mod:`peagle.refresh.steps`) and declares what its stage published as a lineage
pointer. :func:`build` wraps them with the image of their role; ``PROFILE_STEP`` names the cluster
profile's step whose resources, retries and deadline each one takes (the default pipeline's stage
doing the same work; the trigger and the rollout their own small steps, "trigger" and "rollout": no
scratch volume, and the rollout waits for a canary window on the cluster).
"""
from typing import NamedTuple

from kfp.dsl import HTML, Dataset, Metrics, Model, Output

IMAGES = {"refresh_trigger": "base", "refresh_select": "base", "refresh_prepare": "base", "refresh_extract": "vllm",
          "refresh_train": "trainer", "refresh_gate": "vllm", "refresh_rollout": "base"}
PROFILE_STEP = {"refresh_trigger": "trigger", "refresh_select": "prepare", "refresh_prepare": "prepare",
                "refresh_extract": "extract", "refresh_train": "train", "refresh_gate": "evaluate",
                "refresh_rollout": "rollout"}


def refresh_trigger(target: str, serving_draft: str, traffic: str, base_data: str, since: str, until: str,
                    replay_fraction: float, gate_margin: float, gate_tolerance: float, rollout_routing: str,
                    rollout_canary_percent: int, rollout_min_requests: int, rollout_window_s: float,
                    deploy_name: str, deploy_namespace: str, deploy_mode: str, output_root: str, run_name: str,
                    job_id: str, config: str, metrics: Output[Metrics], trigger: Output[Dataset],
                    data_connection: str = "") -> NamedTuple("TriggerOutputs", [("refresh_uri", str), ("go", bool)]):
    """Validates the settings, decides whether a refresh is needed, writes <refresh>/run.json and trigger.json.
    Returns the refresh URI every later step works on and ``go`` (False: 'not needed', the run ends green);
    ``metrics``: the decision's figures; ``trigger``: a pointer to trigger.json (with the reasons)."""
    from peagle.pipeline.refresh_steps import record_trigger
    from peagle.pipeline.refresh_steps import trigger as step

    uri, decision = step(output_root=output_root, run_name=run_name, job_id=job_id, config=config,
                         data_connection=data_connection, metrics=metrics, target=target,
                         serving_draft=serving_draft, traffic=traffic, base_data=base_data, since=since, until=until,
                         replay_fraction=replay_fraction, gate_margin=gate_margin, gate_tolerance=gate_tolerance,
                         rollout_routing=rollout_routing, rollout_canary_percent=rollout_canary_percent,
                         rollout_min_requests=rollout_min_requests, rollout_window_s=rollout_window_s,
                         deploy_name=deploy_name, deploy_namespace=deploy_namespace, deploy_mode=deploy_mode)
    record_trigger(trigger, uri)
    return (uri, decision.go)


def refresh_select(refresh_uri: str, selection: Output[Dataset]):
    """Selects the traffic window of run.json's settings (selection/); ``selection``: lineage pointer (with
    the counts)."""
    from peagle.pipeline.refresh_steps import record, select

    record(selection, refresh_uri, "select", select(refresh_uri))


def refresh_prepare(refresh_uri: str, data: Output[Dataset]):
    """Traffic rows + replayed base rows into data/; ``data``: lineage pointer (with the rows by origin)."""
    from peagle.pipeline.refresh_steps import prepare, record

    record(data, refresh_uri, "prepare", prepare(refresh_uri))


def refresh_extract(refresh_uri: str, hidden_states: Output[Dataset]):
    """The target's hidden states of data/ into hidden_states/."""
    from peagle.pipeline.refresh_steps import extract, record

    extract(refresh_uri)
    record(hidden_states, refresh_uri, "extract")


def refresh_train(refresh_uri: str, draft: Output[Model]) -> str:
    """The candidate draft, warm-started from the serving draft, into draft/; returns its URI."""
    from peagle.pipeline.refresh_steps import record, train

    uri = train(refresh_uri)
    record(draft, refresh_uri, "train")
    return uri


def refresh_gate(refresh_uri: str, candidate_uri: str, metrics: Output[Metrics], report: Output[HTML],
                 gate: Output[Dataset]) -> bool:
    """The paired gate (candidate vs serving draft, real vLLM) into gate/ and lineage.json; the verdict and
    its figures to ``metrics``, the page to ``report``. Returns the verdict (a rejection is not a failure)."""
    from peagle.pipeline.refresh_steps import gate as step
    from peagle.pipeline.refresh_steps import record

    passed = step(refresh_uri, metrics=metrics, html=report)
    record(gate, refresh_uri, "gate", passed=bool(passed), candidate=candidate_uri)
    return passed


def refresh_rollout(refresh_uri: str, candidate_uri: str, rollout_routing: str, deploy_name: str,
                    deploy_namespace: str, deploy_mode: str, data_connection: str, serving: str,
                    metrics: Output[Metrics]) -> str:
    """Rolls the gated candidate out beside the stable deployment (canary, live decision, promotion or
    rollback); ``rollout_routing`` none: skipped, said in the log. Returns promote, rollback or skipped;
    ``metrics``: the live figures and the decision."""
    from peagle.pipeline.refresh_steps import rollout

    return rollout(refresh_uri, candidate_uri, routing=rollout_routing, name=deploy_name,
                   namespace=deploy_namespace, mode=deploy_mode, data_connection=data_connection, serving=serving,
                   metrics=metrics)


def build(profile):
    """KFP components for ``profile`` (a ``peagle.pipeline.profile.ClusterProfile``), by function name."""
    from types import SimpleNamespace

    from kfp import dsl

    images = profile.images.model_dump()
    fns = (refresh_trigger, refresh_select, refresh_prepare, refresh_extract, refresh_train, refresh_gate,
           refresh_rollout)
    return SimpleNamespace(**{fn.__name__: dsl.component(fn, base_image=images[IMAGES[fn.__name__]],
                                                         install_kfp_package=profile.install_kfp_package)
                              for fn in fns})
