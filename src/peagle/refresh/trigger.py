"""Whether a (scheduled) refresh is needed: the first step of the refresh pipeline and ``peagle refresh --trigger``.

:func:`decide_trigger` reads the traffic log and the loop history (:class:`peagle.records.history.LoopHistory`)
and goes on when

* at least ``trigger.min_new_records`` usable records (status 200, chat, this target: the records a refresh
  can train on, :mod:`.selection` steps 1-4) were received since the last refresh's window ended (the
  ``window.until`` of the newest ``refresh`` history record; all of the log when there is none; a window end
  later than now, which an older peagle recorded after a record dated in the future, counts from when that
  record was appended instead), or
* live acceptance fell: the pooled acceptance length (AL) of the newest ``trigger.recent_records`` records of
  the serving draft is at least ``trigger.acceptance_drop`` below the live AL measured for it when it was
  promoted (the newest ``promotion`` record's live candidate AL). The serving draft is the promoted one,
  else the draft that served most of this target's records. Fewer than ``trigger.min_recent_records``
  recent records, or no promotion: no acceptance verdict;
* ``trigger.force`` is set (a manual run).

Every reason carries its figures. When the refresh goes on and ``refresh.since`` is empty, its window starts
where the last refresh's window ended (:func:`window_from_trigger`), so that consecutive scheduled refreshes
train on consecutive windows; ``run.json`` and ``trigger.json`` say so.
"""
from __future__ import annotations

import json
from collections import Counter
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, TypeVar

from ..config import ConfigError
from ..records.history import PROMOTION, LoopHistory
from ..records.identity import fingerprint_of
from ..records.promotion import PromotionRecord
from ..records.trigger import TriggerDecision
from ..stats import pooled_acceptance_length
from ..records.traffic import TrafficRecord
from ..records.base import format_time, parse_time
from ..rollout.settings import TriggerSettings
from .sections import RefreshRunConfig
from .selection import _clean

if TYPE_CHECKING:
    from ..traffic.log import TrafficLog

TRIGGER_JSON = "trigger.json"
NOT_NEEDED = "not needed"

RunConfigT = TypeVar("RunConfigT", bound=RefreshRunConfig)  # window_from_trigger returns the caller's type


def newest_promotion(history: "LoopHistory") -> PromotionRecord | None:
    """The newest promotion on record (read strictly: a damaged record is a
    :class:`~peagle.records.promotion.PromotionError` naming it and the field); None without one."""
    keys = history.keys(PROMOTION)
    if not keys:
        return None
    return PromotionRecord.from_dict(history.read(keys[-1]), history.store.uri_for(keys[-1]))


def _promotion_figures(history: "LoopHistory") -> tuple[str | None, float | None]:
    """(fingerprint, live candidate AL) of the newest promotion on record; (None, None) without one."""
    record = newest_promotion(history)
    if record is None:
        return None, None
    return fingerprint_of(record.fingerprint), record.live.candidate.acceptance_length.value


def _serving_fingerprint(served: list[TrafficRecord]) -> str | None:
    """The draft that served most of ``served`` (ties: the one that served the newest record)."""
    counts = Counter(fingerprint_of(r.draft_fingerprint) for r in served if r.draft_fingerprint)
    if not counts:
        return None
    newest = {fingerprint_of(r.draft_fingerprint): i for i, r in enumerate(served)}
    return max(counts, key=lambda fp: (counts[fp], newest[fp]))


def decide_trigger(log: "TrafficLog", history: "LoopHistory", settings: TriggerSettings, *,
                   target_fingerprint: str, now: datetime | None = None) -> TriggerDecision:
    """Whether the refresh goes on (see the module docstring); reads the log's records received before ``now``."""
    now = now or datetime.now(timezone.utc)
    keys = history.keys("refresh")
    since, late = None, None
    if keys:
        try:
            since = parse_time(history.refresh(keys[-1]).window.until)
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"loop history: the latest refresh record has no window.until timestamp ({exc!r})"
                              ) from None
        if since > now:
            # A window end after now (an older peagle ended the window at a record dated in the future) would
            # count no new record ever again: that refresh covered nothing received after it was recorded.
            late, since = since, min(now, history.appended_at(keys[-1]))
    records = log.records(until=now)
    usable = _clean(records, target_fingerprint, False, Counter())
    new = [r for r in usable if since is None or r.received_at_dt >= since]
    promoted_fp, promoted_al = _promotion_figures(history)
    served = [r for r in records if r.live_histogram is not None
              and r.target_fingerprint == target_fingerprint]  # received_at order
    serving_fp = promoted_fp or _serving_fingerprint(served)
    recent = [r for r in served if fingerprint_of(r.draft_fingerprint) == serving_fp][-settings.recent_records:]
    recent_al = (pooled_acceptance_length(r.live_histogram for r in recent)
                 if len(recent) >= settings.min_recent_records else None)

    where = f"since the last refresh's window ended ({format_time(since)})" if since else "(no refresh recorded yet)"
    if late is not None:
        where = (f"since the last refresh was recorded ({format_time(since)}; its window end {format_time(late)} "
                 "is later than now)")
    enough_new = len(new) >= settings.min_new_records
    reasons = [f"{len(new)} new usable records {where}: "
               + ("at least" if enough_new else "fewer than") + f" trigger.min_new_records={settings.min_new_records}"]
    dropped = False
    if serving_fp is None:
        reasons.append("no record of this target names its draft: no acceptance verdict")
    elif recent_al is None:
        reasons.append(f"{len(recent)} recent records of the serving draft {serving_fp[:12]} with acceptance "
                       f"(< trigger.min_recent_records={settings.min_recent_records}): no acceptance verdict")
    elif promoted_al is None:
        reasons.append(f"live AL of the serving draft {serving_fp[:12]} is {recent_al:.3f} on its newest "
                       f"{len(recent)} records; no promotion recorded to compare with: no acceptance verdict")
    else:
        drop = promoted_al - recent_al
        dropped = drop >= settings.acceptance_drop
        reasons.append(f"live AL of the serving draft {serving_fp[:12]} is {recent_al:.3f} on its newest "
                       f"{len(recent)} records, {drop:+.3f} below {promoted_al:.3f} measured when it was promoted: "
                       + ("at least" if dropped else "less than") + f" trigger.acceptance_drop={settings.acceptance_drop}")
    if settings.force:
        reasons.insert(0, "trigger.force is set: the refresh goes on whatever the figures say")
    return TriggerDecision(go=settings.force or enough_new or dropped, reasons=reasons, new_records=len(new),
                           since=format_time(since) if since else None, recent_al=recent_al,
                           promoted_al=promoted_al, recent_records=len(recent), serving_fingerprint=serving_fp,
                           decided_at=format_time(now))


def run_trigger(cfg: RefreshRunConfig, *, target_fingerprint: str, now: datetime | None = None) -> TriggerDecision:
    """:func:`decide_trigger` on ``refresh.traffic`` and the loop history of ``cfg`` (``rollout.history``)."""
    from ..records.history import history_uri
    from ..traffic.log import TrafficLog

    if not cfg.refresh.traffic:
        raise ConfigError("refresh needs the traffic log: --traffic URI (or refresh.traffic in the config)")
    history = LoopHistory(history_uri(cfg.rollout.history, cfg.refresh.traffic))
    return decide_trigger(TrafficLog(cfg.refresh.traffic), history, cfg.trigger,
                          target_fingerprint=target_fingerprint, now=now)


def window_from_trigger(cfg: RunConfigT, decision: TriggerDecision) -> tuple[RunConfigT, str | None]:
    """``cfg`` with ``refresh.since`` set to where the last refresh's window ended, when the refresh goes on,
    ``refresh.since`` is empty and a refresh was recorded; and the sentence saying so (None: unchanged)."""
    if not decision.go or cfg.refresh.since or decision.since is None:
        return cfg, None
    if cfg.refresh.until and parse_time(cfg.refresh.until) <= parse_time(decision.since):
        raise ConfigError(f"refresh.until ({cfg.refresh.until}) is not after the end of the last refresh's window "
                          f"({decision.since}), where this refresh's window starts: set refresh.since")
    note = (f"refresh.since was empty: the window starts where the last refresh's window ended, "
            f"refresh.since={decision.since}")
    return cfg.model_copy(update={"refresh": cfg.refresh.model_copy(update={"since": decision.since})}), note


def trigger_document(decision: TriggerDecision, cfg: RefreshRunConfig, note: str | None) -> dict[str, Any]:
    """``trigger.json``: the decision, the settings it used, the history it read and the window it set."""
    from ..records.history import history_uri

    return {**decision.to_dict(), "window_note": note,
            "traffic": cfg.refresh.traffic, "history": history_uri(cfg.rollout.history, cfg.refresh.traffic),
            "settings": cfg.trigger.model_dump(mode="json")}


def write_trigger(document: dict[str, Any], root: str) -> str:
    """Put ``trigger.json`` under the refresh's ``root``; returns its URI."""
    from ..stage_io import join
    from ..storage import open_store

    open_store(root).put_bytes(TRIGGER_JSON, (json.dumps(document, indent=1) + "\n").encode())
    return join(root, TRIGGER_JSON)


def log_trigger_metrics(decision: TriggerDecision, metrics: Any) -> None:
    """The decision's figures as KFP metrics (``trigger_go`` 1/0, new and recent records, the two ALs)."""
    metrics.log_metric("trigger_go", 1.0 if decision.go else 0.0)
    metrics.log_metric("trigger_new_records", float(decision.new_records))
    metrics.log_metric("trigger_recent_records", float(decision.recent_records))
    for name in ("recent_al", "promoted_al"):
        value = getattr(decision, name)
        if value is not None:
            metrics.log_metric(f"trigger_{name}", float(value))
