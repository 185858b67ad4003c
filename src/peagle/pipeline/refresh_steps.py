"""What the refresh pipeline's components do: trigger -> select -> prepare (+ replay) -> extract -> train -> gate
-> rollout.

Each function is the whole body of one KFP component (``components/refresh.py`` only calls it) and
calls the step of :mod:`peagle.refresh.steps` that ``peagle refresh`` runs, so the pipeline and
the command cannot differ. Stages hand each other the refresh URI
(``<output_root>/<run_name or job id>``) only; their data lives under it in the
layout of :class:`peagle.refresh.steps.RefreshLayout` (``selection/``, ``data/``,
``hidden_states/``, ``draft/``, ``gate/``, ``lineage.json``), plus ``run.json``: the resolved settings
(:class:`~peagle.pipeline.refresh_params.RefreshRun`) and ``trigger.json`` that :func:`trigger` writes first,
and ``rollout/decision.json`` (:func:`rollout`).

The target and the serving draft are fetched once per pod into the cache (a published prefix) or used
in place (a local directory); the steps get local paths.
"""
from __future__ import annotations

import json
import os
from datetime import datetime
from pathlib import Path
from typing import Any, Mapping

from ..config import ConfigError
from ..records.lineage import Lineage
from ..stage_io import join
from ..storage import check_uri, open_store
from ..storage.settings import with_mounted_connection
from .connection import BUCKET_KEY, check_data_connection
from .layout import bucket_and_key
from .layout import run_uri as make_run_uri
from .objects import read_json, write_json
from .params import _validated, flatten
from .progress import stage
from .refresh_params import RefreshParams, RefreshRun, resolve_refresh
from .steps import fetch

RUN_JSON = "run.json"
# What each stage publishes, by the RefreshLayout attribute naming its prefix (lineage pointers).
STAGE_PREFIXES = {"select": "selection", "prepare": "data", "extract": "hidden_states", "train": "draft",
                  "gate": "gate"}


def layout_of(refresh_uri: str) -> Any:
    from ..refresh.steps import RefreshLayout

    return RefreshLayout.of(refresh_uri)


def load_refresh(refresh_uri: str) -> tuple[RefreshRun, Any]:
    """The refresh run's resolved settings (written by :func:`trigger`) and its layout."""
    return RefreshRun.model_validate(read_json(join(refresh_uri, RUN_JSON))), layout_of(refresh_uri)


def local(uri: str) -> str:
    """A local copy of a model: fetched into the cache once per pod (a published prefix), or the directory."""
    return str(fetch(uri))


def record(artifact: Any, refresh_uri: str, stage_name: str, summary: dict[str, Any] | None = None,
           **extra: Any) -> dict[str, Any]:
    """The lineage pointer (a KFP output artifact) of what ``stage_name`` published (see :mod:`.lineage`), with
    the scalars of the step's ``summary`` (nested keys joined with ``.``)."""
    from .lineage import record_prefix

    prefix = getattr(layout_of(refresh_uri), STAGE_PREFIXES[stage_name])
    scalars = {k: v for k, v in flatten(summary or {}).items() if isinstance(v, (bool, int, float, str))}
    return record_prefix(artifact, str(prefix), f"refresh.{stage_name}", **scalars, **extra)


def record_trigger(artifact: Any, refresh_uri: str) -> dict[str, Any]:
    """The KFP output ``artifact`` of the trigger: ``trigger.json`` itself (a few hundred bytes), its location and
    verdict as metadata (the reasons joined, one line)."""
    from ..refresh.trigger import TRIGGER_JSON

    where = join(refresh_uri, TRIGGER_JSON)
    doc = read_json(where)
    artifact.metadata.update({"stage": "refresh.trigger", "document": where, "go": doc["go"],
                              "new_records": doc["new_records"], "reasons": " | ".join(doc["reasons"])})
    path = Path(artifact.path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    return doc


def _dumps(summary: dict[str, Any]) -> str:
    return json.dumps(summary, sort_keys=True, default=str)


def trigger(*, output_root: str, run_name: str, job_id: str, config: str, data_connection: str = "",
            now: datetime | None = None, metrics: Any = None, **params: Any) -> tuple[str, Any]:
    """Resolve and validate the settings, decide whether the refresh is needed (:mod:`peagle.refresh.trigger`),
    write ``<refresh>/run.json`` and ``<refresh>/trigger.json``, log the decision's figures to ``metrics``.

    Fails before any heavy work when a setting is invalid or the data connection lacks a key a URI needs.
    When it goes on with ``refresh.since`` empty, the window starts where the last refresh's ended (run.json's
    ``window_note`` says so). Returns the refresh URI every later step works on, and the decision.
    """
    from ..model.target import fingerprint_uri
    from ..refresh.trigger import (NOT_NEEDED, log_trigger_metrics, run_trigger, trigger_document,
                                   window_from_trigger, write_trigger)

    with stage("refresh.trigger") as info:
        p = _validated(RefreshParams, params)
        check_data_connection(data_connection, {"output_root": output_root, "target": p.target,
                                                "serving_draft": p.serving_draft, "traffic": p.traffic,
                                                "base_data": p.base_data})
        check_uri(output_root, "output_root")
        uri = make_run_uri(output_root, run_name, job_id)
        run = resolve_refresh(p, config, uri)
        target_fingerprint = fingerprint_uri(p.target)  # the small files and weight headers only
        decision = run_trigger(run.config, target_fingerprint=target_fingerprint, now=now)
        cfg, note = window_from_trigger(run.config, decision)
        run = serving_draft_on_record(run.model_copy(update={"config": cfg, "window_note": note}),
                                      target_fingerprint)
        if run.serving_note:
            print(f"trigger: {run.serving_note}", flush=True)
        write_json(join(uri, RUN_JSON), run.model_dump(mode="json"))
        write_trigger(trigger_document(decision, cfg, note), uri)
        if metrics is not None:
            log_trigger_metrics(decision, metrics)
        info["go"] = decision.go
        for line in (*decision.reasons, *([note] if note else [])):
            print(f"trigger: {line}", flush=True)
        print(f"refresh {uri}: {'refresh needed' if decision.go else NOT_NEEDED + ': the run ends here'}", flush=True)
    return uri, decision


def serving_draft_on_record(run: RefreshRun, target_fingerprint: str) -> RefreshRun:
    """``run`` serving the newest promoted draft of this target when the loop history has one that is not the
    scheduled ``serving_draft`` (``serving_note`` says so): a schedule names the draft served when it was made,
    and every promotion since replaced it. The warm start, the gate's baseline and the rollout's stable are
    then the promoted draft, so a second scheduled run after a promotion can roll out again."""
    from ..records.history import LoopHistory, history_uri
    from ..records.identity import identify_draft
    from ..refresh.trigger import newest_promotion

    cfg = run.config
    promoted = newest_promotion(LoopHistory(history_uri(cfg.rollout.history, cfg.refresh.traffic)))
    if promoted is None or promoted.target_fingerprint not in (None, target_fingerprint):
        return run
    scheduled = run.params.serving_draft
    if identify_draft(scheduled).fingerprint == promoted.fingerprint:
        return run
    note = (f"serving draft {promoted.draft.uri} ({promoted.fingerprint}), promoted {promoted.promoted_at} "
            f"(decision {promoted.decision_id}), not the scheduled serving_draft {scheduled}: the newest promotion "
            "on record serves")
    params = run.params.model_copy(update={"serving_draft": promoted.draft.uri})
    return run.model_copy(update={"params": params, "serving_note": note})


def select(refresh_uri: str) -> dict[str, Any]:
    """Select the traffic window of ``run.json``'s settings; returns the selection's summary (counts, window)."""
    from ..refresh.steps import select_step

    with stage("refresh.select") as info:
        run, layout = load_refresh(refresh_uri)
        summary = select_step(run.config, target=local(run.params.target), layout=layout)
        info["counts"] = summary.get("counts")
        print(f"refresh {refresh_uri}: selected {_dumps(summary)}", flush=True)
    return summary


def prepare(refresh_uri: str) -> dict[str, Any]:
    """Tokenise the selected traffic (served responses as the assistant turns) and mix in the replay rows
    of ``refresh.base_data``; returns the rows per split and origin."""
    from ..refresh.steps import prepare_step

    with stage("refresh.prepare") as info:
        run, layout = load_refresh(refresh_uri)
        summary = prepare_step(run.config, target=local(run.params.target), layout=layout)
        info["rows"] = summary.get("rows")
        print(f"prepared: {_dumps(summary)}", flush=True)
    return summary


def extract(refresh_uri: str) -> None:
    """The target's hidden states of the prepared rows."""
    from ..refresh.steps import extract_step

    with stage("refresh.extract"):
        run, layout = load_refresh(refresh_uri)
        extract_step(run.config, target=local(run.params.target), layout=layout)


def train(refresh_uri: str) -> str:
    """Train the candidate, warm-started from the serving draft; returns the candidate's URI."""
    from ..refresh.steps import train_step

    with stage("refresh.train") as info:
        run, layout = load_refresh(refresh_uri)
        info["candidate"] = candidate = train_step(run.config, target=local(run.params.target),
                                                   serving_draft=local(run.params.serving_draft), layout=layout)
        print(f"candidate draft: {candidate}", flush=True)
    return str(candidate)


def gate(refresh_uri: str, metrics: Any = None, html: Any = None) -> bool:
    """Gate the candidate against the serving draft (real vLLM, paired), log the verdict and its figures to
    ``metrics``, the page to ``html`` (KFP artifacts), write ``lineage.json``; returns the verdict.

    A rejected candidate is a verdict, not a failure: the step succeeds and returns False.
    """
    from ..gate.run import log_gate_metrics
    from ..gate.report import GATE_HTML
    from ..refresh.steps import gate_step, lineage_step

    with stage("refresh.gate") as info:
        run, layout = load_refresh(refresh_uri)
        target = local(run.params.target)
        result = gate_step(run.config, target=target, serving_draft=local(run.params.serving_draft), layout=layout)
        if metrics is not None:
            log_gate_metrics(result, metrics)
        if html is not None:  # the page as published (gate/gate.html), shown in the run's UI
            page = Path(getattr(html, "path", html))
            page.parent.mkdir(parents=True, exist_ok=True)
            page.write_bytes(open_store(str(layout.gate)).get_bytes(GATE_HTML))
        # the serving draft by its URI (lineage names where it lives); the target fingerprinted locally
        lineage_step(run.config, target=target, serving_draft=run.params.serving_draft, layout=layout, gate=result)
        info["passed"] = passed = bool(result.passed)
        print(f"gate {'passed' if passed else 'REJECTED'}: the candidate "
              f"{'beats' if passed else 'does not beat'} the serving draft", flush=True)
    return passed



def _absolute_s3(uri: str, data_connection: str, env: Mapping[str, str] | None = None) -> str:
    """``uri`` naming its bucket: a bucketless ``s3:///key`` (the data connection's own bucket, as the steps read
    it) gets the connection's ``AWS_S3_BUCKET``. KServe's storage initializer reads the bucket from the URI."""
    bucket, key = bucket_and_key(uri)
    if bucket:
        return uri
    keys = with_mounted_connection(os.environ if env is None else env)
    if not keys.get(BUCKET_KEY):
        raise ConfigError(f"{uri} names no bucket and the data connection {data_connection or '(none)'} has no "
                          f"{BUCKET_KEY}: the serving pods could not fetch it; name the bucket in output_root")
    return f"s3://{keys[BUCKET_KEY]}/{key}"


def _serving_values(run: RefreshRun, candidate_uri: str, mode: str, data_connection: str, serving: str,
                    env: Mapping[str, str] | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """(stable values, candidate values): the chart values the stable serves with and the candidate's model
    source over them.

    The stable is the default pipeline's deployment of the base run (``<run>``: the target's run,
    ``<run>/models/target``): ``<run>/models`` through the data connection, its ``num_speculative_tokens`` from
    ``<run>/run.json``, the profile's serving settings -- serving ``<run>/models/draft``, or, once a refresh was
    promoted (the serving draft is then that refresh's draft, :func:`trigger`), serving it as the promotion
    left it: the candidate's model source below with that draft.

    A candidate lives under its refresh (``<refresh>/draft``), away from the target, so it is served from two
    URIs (KServe >= 0.16 ``storageUris``, kserve mode only), each naming its bucket, fetched with the data
    connection's credentials (chart value ``storage.uris.connection``: OpenShift AI's
    ``opendatahub.io/connections`` annotation, or upstream KServe's ServiceAccount)."""
    from ..deploy import values_for
    from ..deploy.render import deep_merge
    from ..records.identity import identify_draft
    from .deployment import ServingSettings, draft_fingerprint, model_location
    from .layout import RunLayout

    if mode != "kserve":
        raise ConfigError(f"deploy_mode={mode}: the candidate ({candidate_uri}) is not under one prefix with the "
                          "target, which only KServe's storageUris serves; roll out with deploy_mode=kserve")
    serving_draft, target = run.params.serving_draft.rstrip("/"), run.params.target.rstrip("/")
    if serving_draft.endswith("/models/draft"):
        layout = RunLayout(serving_draft[: -len("/models/draft")])
    elif target.endswith("/models/target"):
        layout = RunLayout(target[: -len("/models/target")])
    else:
        raise ConfigError(f"serving_draft {serving_draft} is not a run's published draft (<run>/models/draft) and "
                          f"target {target} is not a run's published target (<run>/models/target): the rollout "
                          "serves the stable as the default pipeline deployed it")
    k = read_json(join(layout.root, RUN_JSON))["params"]["num_speculative_tokens"]
    s = ServingSettings.model_validate(json.loads(serving or "{}"))
    bucket, path = model_location(layout)
    stable = values_for(mode=mode, data_connection=data_connection, path=path, bucket=bucket,
                        num_speculative_tokens=int(k), gpus=s.gpus, image=s.image or None,
                        max_model_len=s.max_model_len,
                        draft_fingerprint=draft_fingerprint(layout),
                        extra_args=s.extra_args, extra_values=[s.values] if s.values else [])

    def source(draft: str) -> dict[str, Any]:
        uris = {"target": _absolute_s3(layout.target, data_connection, env),
                "draft": _absolute_s3(draft, data_connection, env)}
        if data_connection:
            uris["connection"] = data_connection
        return {"storage": {"type": "uris", "uris": uris}}

    if serving_draft != layout.draft.rstrip("/"):  # a promoted refresh's draft, served as its promotion left it
        stable = deep_merge(stable, deep_merge(source(serving_draft), {"speculative": {
            "draftFingerprint": identify_draft(serving_draft).fingerprint}}))
    return stable, deep_merge({key: v for key, v in stable.items() if key != "storage"}, source(candidate_uri))


def rollout(refresh_uri: str, candidate_uri: str, *, routing: str, name: str, namespace: str, mode: str,
            data_connection: str, serving: str = "", metrics: Any = None, apis: Any = None,
            **timing: Any) -> str:
    """Roll the gated candidate out beside the stable deployment ``name`` and promote or roll it back on live
    acceptance (:func:`peagle.rollout.controller.run_rollout` over
    :class:`peagle.rollout.cluster.ClusterBackend`, assembled as ``peagle rollout`` assembles it); the decision
    is published under ``<refresh>/rollout/`` (as its manifest metadata), to the loop history and to ``metrics``.
    Returns ``promote``, ``rollback`` or ``skipped`` (``routing`` none, or the gate did not pass: said in the
    log). ``serving``: the profile's serving settings (JSON). A failure or SIGTERM before a decision to promote
    removes the canary (:meth:`peagle.rollout.assemble.ClusterRollout.run`, ``clean_up``); ``timing``: its
    ``clock``/``sleep`` (tests)."""
    with stage("refresh.rollout") as info:
        if routing == "none":
            print(f"rollout_routing=none: the candidate {candidate_uri} is not rolled out (skipped)", flush=True)
            info["decision"] = "skipped"
            return "skipped"
        run, layout = load_refresh(refresh_uri)
        lineage = Lineage.from_dict(read_json(layout.lineage), layout.lineage)  # a "passed": "false" is refused
        gate = lineage.gate
        if gate is None or not gate.passed:
            print(f"the gate did not pass the candidate {candidate_uri}: not rolled out (skipped)", flush=True)
            info["decision"] = "skipped"
            return "skipped"
        from ..deploy.kube import current_namespace
        from ..rollout.assemble import cluster_rollout
        from ..rollout.decision import log_decision_metrics

        cfg = run.config
        stable_values, candidate_values = _serving_values(run, candidate_uri, mode, data_connection, serving)
        plan = cluster_rollout(name=name, namespace=namespace or current_namespace(), routing=routing, mode=mode,
                               stable_values=stable_values, candidate_draft=candidate_uri,
                               candidate_values=candidate_values, gate=gate, lineage=lineage)
        if apis is None:
            from ..deploy.kube import Apis

            apis = Apis.from_environment()
        settings = cfg.rollout.model_copy(update={"routing": routing})
        decision = plan.run(apis, traffic=cfg.refresh.traffic, settings=settings,
                            target_fingerprint=lineage.target.fingerprint,
                            stable_draft=run.params.serving_draft, out=refresh_uri, clean_up=True, **timing)
        if metrics is not None:
            log_decision_metrics(decision, metrics)
        info["decision"] = decision.decision
        print(f"rollout: {decision.decision} ({'; '.join(decision.reasons)})", flush=True)
    return decision.decision
