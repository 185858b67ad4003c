"""The refresh trigger (peagle.refresh.trigger): a real traffic log and loop history in tmp directories decide
whether a scheduled refresh goes on; ``peagle refresh --trigger`` ends 'not needed' with exit 0."""
from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone

import pytest

from peagle.model.target import fingerprint
from peagle.refresh.trigger import decide_trigger, window_from_trigger
from peagle.records.history import LoopHistory
from peagle.records.live import LiveComparison, VersionFigures
from peagle.records.promotion import PromotionRecord
from peagle.rollout.settings import TriggerSettings
from peagle.run_config import RunConfig
from peagle.stats import Estimate
from peagle.traffic.log import TrafficLog, TrafficWriter
from peagle.records.base import format_time
from peagle.traffic.settings import CaptureSettings
from support.loop_records import refresh_entry
from support.traffic_records import spec_decode, traffic_record

T0 = datetime(2026, 12, 3, 12, 0, tzinfo=timezone.utc)
NOW = T0 + timedelta(days=1)
TARGET_FP = "a" * 64
SERVING, OTHER = "d" * 12, "e" * 12  # served drafts by their label (chart draftFingerprint)
GOOD, WORSE = [0, 1, 0, 1], [1, 0, 0, 1]  # acceptance histograms (K=3): AL 3.0 and 2.5


def record(i: int, *, hist=GOOD, draft=SERVING, fp=TARGET_FP, status=200, endpoint="/v1/chat/completions"):
    text = f"question {i}" if endpoint.endswith("chat/completions") else "p"
    return traffic_record(text, when=T0 + timedelta(seconds=i), endpoint=endpoint, response_text=f"answer {i}",
                          status=status, target_fingerprint=fp, draft_fingerprint=draft,
                          spec_decode=spec_decode(hist, num_draft_tokens=3 * sum(hist)))


@pytest.fixture
def loop(tmp_path):
    """A traffic log writer and the loop history beside it (the default place: <traffic>/_loop)."""
    traffic = tmp_path / "traffic"

    def write(records):
        w = TrafficWriter(CaptureSettings(enabled=True, uri=str(traffic), redact=[], retention_days=0,
                                          batch_records=1000))
        for r in records:
            assert w.submit(r)
        assert w.close()

    return write, TrafficLog(str(traffic)), LoopHistory(str(traffic / "_loop"))


def refreshed_until(history: LoopHistory, seconds: int) -> str:
    until = format_time(T0 + timedelta(seconds=seconds))
    history.append("refresh", refresh_entry(until=until))
    return until


def promoted(history: LoopHistory, al: float, draft: str = SERVING) -> None:
    """A promotion record of ``draft`` at live AL ``al`` (a whole one: the history refuses what it cannot read)."""
    def figures(role: str, fp: str, value: float) -> VersionFigures:
        return VersionFigures(role, fp, 64, Estimate(value), Estimate(None), None, 100)

    live = LiveComparison(figures("stable", OTHER, 1.0), figures("candidate", draft, al), Estimate(al - 1.0),
                          format_time(T0), format_time(T0 + timedelta(hours=1)), 0.95, 1000)
    history.append("promotion", PromotionRecord(
        draft={"uri": "s3://b/d", "fingerprint": draft}, target_fingerprint=TARGET_FP, base_draft=None,
        traffic_window=None, replay_fraction=None, gate=None, live=live.to_dict(), decision_id="0" * 32,
        vllm_version=None, promoted_at=format_time(T0), lineage_uri=None, registry=None))


def settings(**kw) -> TriggerSettings:
    return TriggerSettings(**{"min_new_records": 20, "acceptance_drop": 0.2, "recent_records": 10,
                              "min_recent_records": 5, **kw})


def test_not_needed_says_why_with_figures(loop):
    write, log, history = loop
    until = refreshed_until(history, 100)
    # before the last window's end, failed, another target, completions: none of them is new usable traffic
    write([record(i) for i in range(100)] + [record(100 + i) for i in range(10)]
          + [record(120, status=500), record(121, fp="b" * 64), record(122, endpoint="/v1/completions")])
    d = decide_trigger(log, history, settings(), target_fingerprint=TARGET_FP, now=NOW)
    assert not d.go and d.new_records == 10 and d.since == until
    assert f"10 new usable records since the last refresh's window ended ({until})" in d.reasons[0]
    assert "fewer than trigger.min_new_records=20" in d.reasons[0]
    assert d.promoted_al is None and d.recent_al == pytest.approx(3.0) and "no promotion recorded" in d.reasons[1]
    cfg = RunConfig()
    assert window_from_trigger(cfg, d) == (cfg, None)  # not going on: nothing to set


def test_enough_new_records_go_and_the_window_starts_where_the_last_one_ended(loop):
    write, log, history = loop
    until = refreshed_until(history, 50)
    write([record(i) for i in range(80)])
    d = decide_trigger(log, history, settings(), target_fingerprint=TARGET_FP, now=NOW)
    assert d.go and d.new_records == 30 and "at least trigger.min_new_records=20" in d.reasons[0]
    cfg, note = window_from_trigger(RunConfig(), d)
    assert cfg.refresh.since == until and until in note and "refresh.since was empty" in note
    given = RunConfig.model_validate({"refresh": {"since": "2026-12-01T00:00:00Z"}})
    assert window_from_trigger(given, d) == (given, None)  # a window the user set is kept
    # records after `now` are not counted; no refresh recorded yet: the whole log is new
    fresh = LoopHistory(str(log.store.uri) + "/_other")
    d = decide_trigger(log, fresh, settings(), target_fingerprint=TARGET_FP, now=T0 + timedelta(seconds=25))
    assert d.go and d.new_records == 25 and d.since is None and "(no refresh recorded yet)" in d.reasons[0]
    assert window_from_trigger(RunConfig(), d)[1] is None


def test_a_window_end_after_now_counts_from_when_that_refresh_was_recorded(loop):
    """A history whose last window ended at a record dated 9999 (as an older peagle recorded it) must not
    count "0 new usable records" forever: the new traffic is what came after that refresh was appended."""
    write, log, _ = loop
    history = LoopHistory(log.store.uri + "/_loop", clock=lambda: T0 + timedelta(seconds=60))
    history.append("refresh", refresh_entry(until="9999-12-31T00:00:00.000001Z", verdict=None))
    write([record(i) for i in range(160)])
    d = decide_trigger(log, history, settings(), target_fingerprint=TARGET_FP, now=NOW)
    assert d.go and d.new_records == 100 and d.since == format_time(T0 + timedelta(seconds=60))
    assert "9999-12-31" in d.reasons[0]
    assert window_from_trigger(RunConfig(), d)[0].refresh.since == d.since


def test_a_fall_in_live_acceptance_goes_on_without_new_traffic(loop):
    write, log, history = loop
    refreshed_until(history, 1000)
    promoted(history, 3.0)
    # the serving draft got worse on its newest 10 records; another draft's records do not count
    write([record(i) for i in range(20)] + [record(20 + i, hist=WORSE) for i in range(10)]
          + [record(40 + i, draft=OTHER) for i in range(5)])
    d = decide_trigger(log, history, settings(), target_fingerprint=TARGET_FP, now=NOW)
    assert d.go and d.new_records == 0
    assert (d.recent_al, d.promoted_al, d.recent_records) == (pytest.approx(2.5), 3.0, 10)
    assert d.serving_fingerprint == SERVING
    assert "is 2.500 on its newest 10 records, +0.500 below 3.000 measured when it was promoted" in d.reasons[1]
    assert "at least trigger.acceptance_drop=0.2" in d.reasons[1]
    # a smaller fall than acceptance_drop, or too few recent records: no reason to go
    d = decide_trigger(log, history, settings(acceptance_drop=0.6), target_fingerprint=TARGET_FP, now=NOW)
    assert not d.go and "less than trigger.acceptance_drop=0.6" in d.reasons[1]
    d = decide_trigger(log, history, settings(min_recent_records=50, recent_records=100),
                       target_fingerprint=TARGET_FP, now=NOW)
    assert not d.go and d.recent_al is None and "30 recent records" in d.reasons[1]


def test_without_a_promotion_the_serving_draft_is_the_one_that_served_most(loop):
    write, log, history = loop
    write([record(i, draft=OTHER) for i in range(3)] + [record(3 + i) for i in range(6)])
    d = decide_trigger(log, history, settings(), target_fingerprint=TARGET_FP, now=NOW)
    assert d.serving_fingerprint == SERVING and d.recent_records == 6


def test_records_spelling_the_served_draft_by_its_whole_digest_count_for_its_fingerprint(loop):
    """A plain ``peagle serve`` recorded the whole 64-digit digest, a promotion names the 12-digit fingerprint:
    one draft, so the trigger finds its acceptance (it found none before: two spellings of one identity)."""
    write, log, history = loop
    promoted(history, 3.0)
    write([record(i, hist=WORSE, draft=SERVING + "f" * 52) for i in range(10)])
    d = decide_trigger(log, history, settings(), target_fingerprint=TARGET_FP, now=NOW)
    assert d.serving_fingerprint == SERVING and d.recent_records == 10 and d.recent_al == pytest.approx(2.5)


def test_force_always_goes(loop):
    write, log, history = loop
    refreshed_until(history, 100)
    d = decide_trigger(log, history, settings(force=True), target_fingerprint=TARGET_FP, now=NOW)
    assert d.go and d.new_records == 0 and d.reasons[0].startswith("trigger.force is set")
    assert "0 new usable records" in d.reasons[1]


def test_refresh_trigger_option_exits_0_when_not_needed(tmp_path, capsys):
    from peagle.commands.refresh import main

    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text("{}")
    traffic = tmp_path / "traffic"
    w = TrafficWriter(CaptureSettings(enabled=True, uri=str(traffic), redact=[], retention_days=0))
    for i in range(3):
        assert w.submit(record(i, fp=fingerprint(target)))
    assert w.close()
    out = tmp_path / "refresh"
    code = main(["--target", str(target), "--serving-draft", str(tmp_path / "not-a-draft"), "--traffic",
                 str(traffic), "--out", str(out), "--trigger", "--set", "trigger.min_new_records=10"])
    text = capsys.readouterr().out
    assert code == 0 and "3 new usable records (no refresh recorded yet)" in text and "not needed" in text
    doc = json.loads((out / "trigger.json").read_text())
    assert doc["format"] == "peagle.refresh.trigger/v1" and doc["go"] is False and doc["new_records"] == 3
    assert doc["history"] == str(traffic / "_loop") and doc["settings"]["min_new_records"] == 10
