"""``peagle refresh``: a window of captured traffic into a candidate draft, gated against the serving draft.

    peagle refresh --config run.yaml --target T --serving-draft D --traffic URI --base-data PREPARED \\
        --out DIR [--since ISO] [--until ISO] [--no-gate] [--trigger]

Steps (each a function of the run configuration and a :class:`RefreshLayout`; the KFP refresh
pipeline calls the same functions):

1. :func:`select_step` -- read the window of the traffic log, clean and split it by time
   (:mod:`.selection`) into ``selection/``; with ``refresh.sampled_responses=regenerate`` the target
   answers the sampled records again, greedily (the regenerate stage, which rewrites every assistant
   turn of those conversations);
2. :func:`prepare_step` -- the prepare stage on the selected conversations (served responses as
   assistant turns), then ``refresh.replay_fraction`` of the training rows drawn from the serving
   draft's own prepared data (``refresh.base_data``), into ``data/``;
3. :func:`extract_step` -- the target's hidden states of both splits into ``hidden_states/``;
4. :func:`train_step` -- training warm-started from the serving draft (``train.init_from``), the
   candidate published at ``draft/`` (checkpoints in ``train/``);
5. :func:`gate_step` -- :func:`peagle.gate.run.run_gate` on the held-out newest traffic and the
   general set, into ``gate/``;
6. :func:`lineage_step` -- ``lineage.json``: the window covered, row counts, replay, base draft, verdict;
   and a ``refresh`` record in the loop history (``rollout.history``), where the next trigger starts counting.

Before any work, :func:`check_outputs` checks every output as the other stages do: ``--out`` is not, does not hold
and does not lie inside an input (``--base-data`` included), holds nothing but a refresh's outputs, and each
published output there replaces only an earlier one of its kind.

``--trigger`` first asks :mod:`.trigger` whether the refresh is needed at all: "not needed" exits 0 before any
work; with an empty ``--since`` the window starts where the last refresh's window ended.

Exit status: 0 the candidate passed the gate (or ``--no-gate``), 1 the gate rejected it, 2 bad
configuration or input (too little usable traffic in the window: the message names the counts).
"""
from __future__ import annotations

import json
import logging
import random
import time
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from .. import __version__
from .. import config as C
from ..records.base import format_time, parse_time
from ..records.lineage import Lineage
from ..data.errors import PrepareError
from ..data.output import SPLITS, PreparedData, PreparedHeader, PreparedWriter
from ..data.rows import PreparedRow
from ..extract.run import extract_prepared
from ..stage_io import fetched_input, is_remote, join
from ..traffic.settings import RefreshSettings
from .sections import RefreshRunConfig
from .selection import COUNTS_FILE, HELDOUT_FILE, REGENERATE_FILE, TRAIN_FILE, describe_counts

if TYPE_CHECKING:
    from ..gate.run import GateResult

log = logging.getLogger(__name__)

RunConfigT = TypeVar("RunConfigT", bound=RefreshRunConfig)  # _with returns the caller's type

SELECTION_KIND = "peagle-traffic-selection"
PREPARED_KIND = "peagle-prepared"  # as ``peagle prepare`` publishes it
REGENERATED_FILE = "regenerated.jsonl"
REPLAY_LABEL = "replay"  # sample ids of replayed rows start with "replay/" (never a prepare source label here)


OUTPUT_NAMES = ("selection", "data", "hidden_states", "train", "draft", "gate", "lineage.json")  # RefreshLayout's
TRIGGER_NAME = "trigger.json"  # refresh --trigger's decision, beside them


@dataclass(frozen=True)
class RefreshLayout:
    """Where one refresh keeps its outputs (local paths or URIs under ``root``)."""

    root: str
    selection: str  # train.jsonl, heldout.jsonl (prompt file), counts.json [, regenerate/regenerated.jsonl]
    data: str  # prepared rows: traffic + replay
    hidden_states: str  # one extraction per split below it
    train: str  # checkpoints
    draft: str  # the candidate draft (vLLM format)
    gate: str  # gate.json, gate.html
    lineage: str  # lineage.json

    @classmethod
    def of(cls, out: str) -> "RefreshLayout":
        root = str(out).rstrip("/") or str(out)
        return cls(root, *(join(root, name) for name in OUTPUT_NAMES))

    def hidden_states_of(self, split: str) -> str:
        return join(self.hidden_states, split)


@dataclass
class RefreshOutcome:
    layout: RefreshLayout
    selection: dict[str, Any]  # select_step's summary
    data: dict[str, Any]  # prepare_step's summary
    candidate_draft: str
    gate: "GateResult | None"
    lineage: Lineage

    @property
    def passed(self) -> bool | None:
        """The gate's verdict; None when the gate was not run."""
        return None if self.gate is None else bool(self.gate.passed)


# ----------------------------------------------------------------------------------------------
# Helpers


def _with(cfg: RunConfigT, **dotted: Any) -> RunConfigT:
    """``cfg`` with ``section__key=value`` settings changed, validated again as its own type (the caller's run
    configuration, its validators included; a bad value names the key)."""
    data = cfg.model_dump()
    for key, value in dotted.items():
        section, name = key.split("__", 1)
        data[section][name] = value
    try:
        return type(cfg).model_validate(data)
    except ValueError as exc:
        raise C.ConfigError(f"refresh: {exc}") from None


def _window(settings: RefreshSettings) -> tuple[datetime | None, datetime | None]:
    """``refresh.since``/``until`` as aware UTC datetimes (None when empty); ConfigError naming the key."""
    out = []
    for name in ("since", "until"):
        text = getattr(settings, name)
        try:
            out.append(parse_time(text) if text else None)
        except ValueError:
            raise C.ConfigError(f"refresh.{name}={text!r} is not an ISO 8601 timestamp "
                                "(e.g. 2026-12-03T15:00:00Z)") from None
    if out[0] is not None and out[1] is not None and out[0] >= out[1]:
        raise C.ConfigError(f"refresh.since ({settings.since}) is not before refresh.until ({settings.until})")
    return out[0], out[1]


def _nonempty(path: Path) -> bool:
    return path.is_file() and path.stat().st_size > 0


def _draft_identity(uri: str) -> dict[str, Any]:
    """Where a published draft is and which one it is (its fingerprint: what served traffic records)."""
    from ..model.adapter import Draft

    draft = Draft.open(uri)
    return {"uri": str(uri), "fingerprint": draft.identity.fingerprint, "manifest_sha256": draft.manifest_sha256}


def check_outputs(cfg: RefreshRunConfig, *, serving_draft: str, out: str) -> RefreshLayout:
    """The output check of the other stages (:func:`peagle.stage_io.check_output`), before any work, on
    every output of a refresh into ``out``: none is, holds or lies inside an input (the target, the
    serving draft, the traffic log, ``refresh.base_data``); each published output there (selection,
    data, draft, gate) may only replace an earlier one of its kind; and an existing ``out`` holds
    nothing but a refresh's outputs. OutputError (exit 2) naming the output otherwise."""
    from ..model.adapter import DRAFT_KIND
    from ..stage_io import OutputError, check_not_an_input, check_output, output_dir
    from ..gate.report import GATE_KIND

    layout = RefreshLayout.of(out)
    inputs = [cfg.target.path, serving_draft, cfg.refresh.traffic, cfg.refresh.base_data]
    if not is_remote(layout.root):
        root = output_dir(layout.root)
        check_not_an_input(root, inputs, layout.root)
        own = {*OUTPUT_NAMES, TRIGGER_NAME, "run.json", "rollout"}  # run.json, rollout/: the pipeline's
        if root.is_dir():
            foreign = sorted(p.name for p in root.iterdir() if p.name not in own and not p.name.startswith("."))
            if foreign:
                raise OutputError(f"{out} holds {foreign[0]}, which is not a refresh output; refusing to write a "
                                  "refresh there (choose a new directory for each refresh)")
        elif root.exists():
            raise OutputError(f"{out} exists and is not a directory; refusing to write a refresh there")
    for where, kind in ((layout.selection, SELECTION_KIND), (layout.data, PREPARED_KIND),
                        (layout.draft, DRAFT_KIND), (layout.gate, GATE_KIND)):
        check_output(where, kind, inputs)
    return layout


def _read_selection_summary(layout: RefreshLayout) -> dict[str, Any]:
    return json.loads((fetched_input(layout.selection) / COUNTS_FILE).read_text(encoding="utf-8"))


# ----------------------------------------------------------------------------------------------
# Steps


def select_step(cfg: RefreshRunConfig, *, target: str, layout: RefreshLayout) -> dict[str, Any]:
    """Select the training and held-out traffic of ``refresh.traffic`` in the window into ``layout.selection``.

    Returns the selection summary (``counts``, ``window``, ``sampled_responses``; ``regenerated`` when
    sampled responses were regenerated). :class:`~.selection.TrafficSelectionError` (exit 2) when the
    window holds too little usable traffic of this target.
    """
    from ..model.target import fingerprint
    from ..stage_io import staged
    from ..traffic.log import TrafficLog
    from .selection import select_traffic, write_selection

    s = cfg.refresh
    if not s.traffic:
        raise C.ConfigError("refresh needs the traffic log: --traffic URI (or refresh.traffic in the config)")
    since, until = _window(s)
    # An empty refresh.until is now: records dated later are counted as "future", never the window's end.
    now = datetime.now(timezone.utc)
    records = TrafficLog(s.traffic).records(since=since, until=until)
    selection = select_traffic(records, target_fingerprint=fingerprint(target), settings=s, now=now)
    summary = {**selection.summary(), "selected_at": format_time(now)}
    with staged(layout.selection, kind=SELECTION_KIND) as tmp:
        paths = write_selection(selection, tmp)
        if REGENERATE_FILE in paths:
            summary["regenerated"] = _regenerate(cfg, target, paths[REGENERATE_FILE], tmp / REGENERATED_FILE)
            (tmp / COUNTS_FILE).write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")
    return summary


def _regenerate(cfg: RefreshRunConfig, target: str, conversations: Path, out: Path) -> dict[str, int]:
    """The target answers the sampled conversations again, greedily (the regenerate stage)."""
    from ..data.regenerate import run_regenerate

    # The target already answered these prompts when it served them: no prompt cap of the run's own
    # regeneration (the embedded default's 128 tokens left 101 of 123 HumanEval prompts empty).
    settings = cfg.regenerate.model_copy(update={"sources": [str(conversations)], "max_conversations": None,
                                                 "temperature": 0.0, "max_prompt_tokens": None})
    result = run_regenerate(settings, target, out, template_time_limit_s=cfg.prepare.template_time_limit_s)
    return dict(result.counts)


def _replayed(base: PreparedData, split: str, indices: list[int]) -> list[PreparedRow]:
    """The rows of ``split`` of the base data at ``indices``, their sample ids under ``replay/``."""
    rows = base.rows(split)
    return [replace(row, sample_id=f"{REPLAY_LABEL}/{row.sample_id}", split_key=f"{REPLAY_LABEL}/{row.split_key}")
            for row in (rows[i] for i in indices)]


def replay_count(traffic_rows: int, fraction: float) -> int:
    """Base rows to mix into ``traffic_rows`` so that they are ``fraction`` of the merged rows."""
    return round(fraction * traffic_rows / (1.0 - fraction))


def prepare_step(cfg: RefreshRunConfig, *, target: str, layout: RefreshLayout) -> dict[str, Any]:
    """Prepare the selected conversations with the run's ``prepare`` settings, mix in the replay rows and
    publish the merged prepared data at ``layout.data``; returns the rows per split and origin.

    Replay: ``refresh.replay_fraction`` of the final rows of each split are drawn (seed ``refresh.seed``,
    without replacement) from the same split of ``refresh.base_data``, which must have been rendered
    with the same tokenizer. With fewer base rows than that, all of them (``replay_short`` says so).
    """
    from ..data import run_prepare
    from ..scratch import scratch_dir

    s = cfg.refresh
    if s.replay_fraction > 0 and not s.base_data:
        raise C.ConfigError("refresh.replay_fraction > 0 needs the serving draft's prepared data: --base-data URI "
                            "(or refresh.base_data); --set refresh.replay_fraction=0 trains on traffic alone")
    selection = fetched_input(layout.selection)
    sources = [str(p) for p in (selection / TRAIN_FILE, selection / REGENERATED_FILE) if _nonempty(p)]
    if not sources:
        raise PrepareError(f"{layout.selection}: no training conversations (train.jsonl and regenerated.jsonl "
                           "are empty)")
    settings = cfg.prepare.model_copy(update={"sources": sources})
    base = PreparedData.open(s.base_data) if s.replay_fraction > 0 else None
    with scratch_dir("peagle-refresh-prepare-") as tmp:
        result = run_prepare(settings, target, tmp / "traffic", trust_remote_code=cfg.target.trust_remote_code)
        traffic = PreparedData.open(tmp / "traffic")
        if base is not None and base.header.target.tokenizer_sha256 != traffic.header.target.tokenizer_sha256:
            raise PrepareError(f"refresh.base_data {s.base_data} was rendered with another tokenizer "
                               f"({base.header.target.path}) than the target {target}: its token ids cannot be mixed")
        rng = random.Random(s.seed)
        rows: dict[str, list[PreparedRow]] = {}
        summary: dict[str, Any] = {"traffic_rows": {}, "replayed_rows": {}, "rows": {}, "replay_short": False,
                                   "replay_fraction": s.replay_fraction, "base_data": s.base_data or None,
                                   "prepare_counts": dict(result.counts)}
        for split in SPLITS:
            own = traffic.rows(split)
            wanted = replay_count(len(own), s.replay_fraction) if base is not None else 0
            available = base.header.rows(split) if base is not None else 0
            n = min(wanted, available)
            replayed = _replayed(base, split, sorted(rng.sample(range(available), n))) if n else []
            rows[split] = own + replayed
            summary["traffic_rows"][split], summary["replayed_rows"][split] = len(own), n
            summary["rows"][split] = len(rows[split])
            summary["replay_short"] |= n < wanted
        _write_prepared(layout.data, rows, traffic.header, summary, base, settings.shard_rows)
    return summary


def _write_prepared(out: str, rows: dict[str, list[PreparedRow]], header: PreparedHeader, summary: dict[str, Any],
                    base: PreparedData | None, shard_rows: int) -> None:
    """Publish ``rows`` as a prepared dataset: the traffic's manifest with the merged shards and counts."""
    from ..stage_io import staged

    description = dict(header.metadata)
    counts = dict(description["counts"])
    counts.update(kept=len(rows["train"]) + len(rows["validation"]), train=len(rows["train"]),
                  validation=len(rows["validation"]), replayed=sum(summary["replayed_rows"].values()))
    description["counts"] = counts
    if base is not None:
        description["sources"] = [*description["sources"], {"spec": base.uri, "label": REPLAY_LABEL,
                                                             "location": base.uri,
                                                             "replayed": dict(summary["replayed_rows"])}]
    with staged(out, kind=PREPARED_KIND, inputs=[base.uri] if base is not None else []) as tmp, \
            PreparedWriter(tmp, shard_rows) as writer:
        for split, split_rows in rows.items():
            for row in split_rows:
                writer.add(split, row)
            writer.flush(split)  # a split's shards before the next split's, as they are listed
        writer.publish(description, refresh=summary)


def extract_step(cfg: RefreshRunConfig, *, target: str, layout: RefreshLayout) -> None:
    """Hidden states of the target on both splits of ``layout.data`` (as ``peagle extract`` does)."""
    for part in extract_prepared(layout.data, target, layout.hidden_states_of, cfg.extract):
        if part.result is not None:
            log.info("extract %s: %d samples -> %s", part.split, part.result.num_samples, part.result.out_dir)


def train_step(cfg: RefreshRunConfig, *, target: str, serving_draft: str, layout: RefreshLayout) -> str:
    """Train the candidate on ``layout.hidden_states`` warm-started from ``serving_draft``
    (``train.init_from``: its weights and draft vocabulary), ``refresh.epochs`` passes at ``refresh.lr_scale`` times
    the run's learning rate (re-warmed over ``refresh.warmup_steps``), with the refresh's levers
    on the serving draft's predictions (``refresh.anchor_weight``, ``refresh.rejected_weight``); publish it at
    ``layout.draft``, return that."""
    from ..model.adapter import DRAFT_KIND
    from ..stage_io import copy_published
    from ..train import TrainError, train

    if cfg.refresh.vocab != "keep":
        raise C.ConfigError(f"refresh.vocab={cfg.refresh.vocab}: a warm start keeps the serving draft's vocabulary; "
                            "re-deriving it is not implemented (use refresh.vocab=keep)")
    for lever in ("anchor_weight", "rejected_weight"):
        if getattr(cfg.train, lever):
            raise C.ConfigError(f"train.{lever}={getattr(cfg.train, lever):g} in a refresh: the refresh sets it from "
                                f"refresh.{lever}; set that instead")
    r = cfg.refresh
    schedule = {"train__lr": cfg.train.lr * r.lr_scale}
    if r.warmup_steps is not None:
        schedule["train__warmup_steps"] = r.warmup_steps
    run = _with(cfg, target__path=target, train__data=layout.hidden_states_of("train"), train__output=layout.train,
                train__init_from=serving_draft, train__anchor_weight=r.anchor_weight,
                train__rejected_weight=r.rejected_weight, train__epochs=r.epochs, **schedule)
    result = train(run)
    if not result.final_uri:
        raise TrainError(f"training into {layout.train} published no draft")
    return copy_published(result.final_uri, layout.draft, kind=DRAFT_KIND)


def gate_step(cfg: RefreshRunConfig, *, target: str, serving_draft: str, layout: RefreshLayout) -> "GateResult":
    """Compare the candidate at ``layout.draft`` with ``serving_draft`` (:func:`peagle.gate.run.run_gate`)
    on the held-out traffic prompts and ``gate.general``; writes ``layout.gate``."""
    from ..gate.run import run_gate

    prompts = fetched_input(layout.selection) / HELDOUT_FILE
    return run_gate(target=target, serving_draft=serving_draft, candidate_draft=layout.draft,
                    traffic_prompts=str(prompts), general=cfg.gate.general, settings=cfg.gate, out=layout.gate)


def lineage_step(cfg: RefreshRunConfig, *, target: str, serving_draft: str, layout: RefreshLayout,
                 gate: "GateResult | None") -> Lineage:
    """Write ``layout.lineage`` (``peagle.traffic.lineage/v1``) and return it: the traffic window asked for and
    covered, the selection counts, rows from traffic and replayed, the base draft and data, the target, the
    candidate and the gate's verdict (None: not gated); appends the refresh to the loop history (its window's end
    is where the next trigger counts new traffic from). Reads what the earlier steps published."""
    from ..model.target import fingerprint
    from ..storage import open_store

    selection = _read_selection_summary(layout)
    data = dict(PreparedData.open(layout.data).header.metadata["refresh"])
    window = selection["window"]
    firsts = [p["first_received_at"] for p in window.values() if p["first_received_at"]]
    lasts = [p["last_received_at"] for p in window.values() if p["last_received_at"]]
    lineage = Lineage(**{
        "peagle_version": __version__,
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "traffic": {"uri": cfg.refresh.traffic, "since": cfg.refresh.since or None, "until": cfg.refresh.until or None,
                    "selected_at": selection.get("selected_at"),
                    "covered": {"first_received_at": min(firsts), "last_received_at": max(lasts), **window}},
        "counts": selection["counts"],
        "sampled_responses": selection["sampled_responses"],
        "regenerated": selection.get("regenerated"),
        "rows": {"traffic": data["traffic_rows"], "replayed": data["replayed_rows"], "total": data["rows"]},
        "replay": {"fraction": data["replay_fraction"], "base_data": data["base_data"],
                   "rows": data["replayed_rows"], "short": data["replay_short"]},
        "target": {"path": str(target), "fingerprint": fingerprint(target)},
        "base_draft": _draft_identity(serving_draft),
        "candidate_draft": _draft_identity(layout.draft),
        "gate": None if gate is None else {"passed": bool(gate.passed), "reasons": list(gate.reasons),
                                           "report": join(layout.gate, "gate.json")},
        "settings": {"refresh": cfg.refresh.model_dump(mode="json"), "gate": cfg.gate.model_dump(mode="json")},
        "outputs": {"selection": layout.selection, "data": layout.data, "hidden_states": layout.hidden_states,
                    "draft": layout.draft, "gate": layout.gate, "lineage": layout.lineage},
    })
    store = open_store(layout.root)
    store.put_bytes(layout.lineage.rsplit("/", 1)[-1], (json.dumps(lineage.to_dict(), indent=1) + "\n").encode())
    _record_refresh(cfg, layout, lineage)
    return lineage


def _record_refresh(cfg: RefreshRunConfig, layout: RefreshLayout, lineage: Lineage) -> str:
    """Append this refresh to the loop history (kind ``refresh``): its window, counts, candidate and verdict.

    ``window.until`` is where the next refresh's new traffic starts (:mod:`.trigger`): ``refresh.until``, else
    just after the newest record this refresh covered (``[since, until)``, as the traffic log reads windows).
    """
    from datetime import timedelta

    from ..records.history import LoopHistory, history_uri
    from ..records.refresh import RefreshEntry

    traffic = lineage.traffic
    until = traffic.until or format_time(parse_time(traffic.covered.last_received_at) + timedelta(microseconds=1))
    if traffic.selected_at and parse_time(until) > parse_time(traffic.selected_at):
        until = traffic.selected_at  # a refresh.until in the future: what comes later is not covered yet
    gate = lineage.gate
    entry = RefreshEntry(
        refresh_uri=layout.root, lineage=layout.lineage, created_at=lineage.created_at,
        window={"since": traffic.since, "until": until, "first_received_at": traffic.covered.first_received_at,
                "last_received_at": traffic.covered.last_received_at},
        counts=lineage.counts, rows=lineage.rows["total"], target_fingerprint=lineage.target.fingerprint,
        base_draft=lineage.base_draft, candidate=lineage.candidate_draft,
        verdict=None if gate is None else ("passed" if gate.passed else "rejected"))
    return LoopHistory(history_uri(cfg.rollout.history, cfg.refresh.traffic)).append("refresh", entry)


def refresh(cfg: RefreshRunConfig, *, target: str, serving_draft: str, out: str, gate: bool = True,
            say=print) -> RefreshOutcome:
    """Run every step in order into ``out`` (see the module docstring); ``gate=False`` skips the gate.

    ``out`` should be new for each refresh: a rerun into the same ``out`` resumes the extraction and the
    training there, which refuse data that changed since.
    """
    from ..model.adapter import Draft

    layout = check_outputs(cfg, serving_draft=serving_draft, out=out)  # before any work
    started = time.monotonic()
    Draft.open(serving_draft)  # a serving draft that is not one stops the refresh before any work

    def done(what: str) -> None:
        say(f"[{time.monotonic() - started:6.0f}s] {what}")

    selection = select_step(cfg, target=target, layout=layout)
    done(f"selected traffic: {describe_counts(selection['counts'])}")
    data = prepare_step(cfg, target=target, layout=layout)
    done(f"prepared rows: traffic {data['traffic_rows']}, replayed {data['replayed_rows']} "
         f"(replay_fraction={data['replay_fraction']})")
    extract_step(cfg, target=target, layout=layout)
    done(f"extracted hidden states: {layout.hidden_states}")
    candidate = train_step(cfg, target=target, serving_draft=serving_draft, layout=layout)
    done(f"trained candidate draft: {candidate}")
    result = gate_step(cfg, target=target, serving_draft=serving_draft, layout=layout) if gate else None
    if result is not None:
        done(f"gate {'passed' if result.passed else 'REJECTED'}: {layout.gate}")
    lineage = lineage_step(cfg, target=target, serving_draft=serving_draft, layout=layout, gate=result)
    done(f"lineage: {layout.lineage}")
    return RefreshOutcome(layout, selection, data, candidate, result, lineage)
