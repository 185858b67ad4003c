"""``evaluate(cfg)``: prompts -> live vLLM measurement (+ offline agreement) -> report.json/.html -> gate.

Outputs in ``evaluate.out``: ``report.json`` (:mod:`peagle.evaluate.report`), ``report.html``
(:mod:`peagle.evaluate.html_report`) and, in offline mode, ``engine_outputs.json``: per engine
(``num_speculative_tokens``, 0 = the target alone) and workload the generated token ids, the
prompt token ids, texts, timings and counter differences. The baseline's greedy outputs there are
the target's own responses to the prompts (usable as regenerated training data).

Checks run before any engine starts: prompt sets load, the draft is intact (a published draft
matches its ``_MANIFEST.json``, every file re-hashed; every weight is finite), the draft matches the
target, the K sweep is within the draft's trained depths (unless allowed), the context length fits
the target and the prompts (:func:`context_length`), the hidden-state dataset (if any) was
extracted from this target with the draft's layers.
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config import ConfigError
from ..records.identity import identify_draft
from ..stage_io import check_not_an_input, check_writable
from ..storage.base import atomic_path
from .counters import CounterError
from .html_report import render_html
from .live import build_workloads, run_offline_api, samplings_of
from .prompts import load_prompt_sets
from .report import apply_gate, build_report, headline_k
from .settings import EvaluateRunConfig, EvaluateSettings
from ..errors import PeagleError

log = logging.getLogger(__name__)

DEFAULT_MAX_MODEL_LEN = 4096  # when neither the target nor the prompts say (vLLM's own check applies)
# Room beyond the longest prompt + max_tokens: the draft's K proposals near the end of a sequence, and a
# chat template rendered by vLLM a few tokens apart from transformers'.
CONTEXT_MARGIN = 64
REPORT_JSON = "report.json"
REPORT_HTML = "report.html"
ENGINE_OUTPUTS = "engine_outputs.json"  # offline mode: every engine's raw outputs and counters per workload
SPEED_TIMINGS = "speed_timings.json"  # every request of the speed measurement, as timed


class EvaluationError(PeagleError, RuntimeError):
    """The measurement itself failed (vLLM did not start or crashed, an endpoint broke off)."""

    exit_code = 3


@dataclass
class EvaluationOutcome:
    report: dict[str, Any]
    passed: bool
    report_json: Path
    report_html: Path


def _draft_info(draft_dir: str) -> tuple[dict[str, Any], Any]:
    from ..model import read_spec

    verified = verify_draft(draft_dir)
    spec = read_spec(draft_dir)
    info = {"path": str(Path(draft_dir).resolve()), "sha256": identify_draft(draft_dir).digest,
            "trained_depths": spec.num_depths, "mask_token_id": spec.mask_token_id, "arch": spec.arch,
            "num_layers": spec.num_layers, "draft_vocab_size": spec.draft_vocab_size,
            "checksum_verified": verified}
    return info, spec


def verify_draft(draft_dir: str | os.PathLike) -> bool:
    """Refuse a draft that is damaged or cannot serve, before anything loads it (CheckpointError, exit 2).

    A published draft (``_MANIFEST.json``/``_SUCCESS``, as ``save_draft`` and training write it) must
    match its manifest, every file re-hashed; then every floating-point tensor of its safetensors files
    must be finite (NaN or inf weights make vLLM emit garbage, not fail). Returns whether the checksums
    were verified: a directory with no manifest (assembled by hand) gets the finite check only, and a
    warning says it was not checksum-verified."""
    from ..model import CheckpointError
    from ..storage import (MANIFEST, SUCCESS, ChecksumMismatchError, IncompletePrefixError, LocalStore,
                           open_published)

    root = Path(draft_dir)
    if not root.is_dir():
        raise CheckpointError(f"evaluate.draft {draft_dir} is not a directory")
    published = (root / MANIFEST).exists() or (root / SUCCESS).exists()
    if published:
        try:
            open_published(LocalStore(root), "", deep=True)
        except (IncompletePrefixError, ChecksumMismatchError) as exc:
            raise CheckpointError(f"evaluate.draft {draft_dir} is damaged: {exc}") from None
    else:
        log.warning("evaluate.draft %s has no %s: not checksum-verified (only its weights are checked for "
                    "NaN/inf)", draft_dir, MANIFEST)
    for f in sorted(root.glob("*.safetensors")):
        check_finite(f)
    return published


def check_finite(path: Path) -> None:
    """CheckpointError naming ``path`` and the tensor if a floating-point tensor holds NaN or inf."""
    import torch
    from safetensors import safe_open

    from ..model import CheckpointError

    try:
        with safe_open(str(path), "pt") as fh:
            for name in fh.keys():
                t = fh.get_tensor(name)
                if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                    bad = int((~torch.isfinite(t)).sum())
                    raise CheckpointError(f"{path}: tensor {name} holds {bad} NaN or infinite values; "
                                          "this draft cannot serve (did training diverge?)")
    except CheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types for a broken file
        raise CheckpointError(f"{path}: not a readable safetensors file ({type(exc).__name__}: "
                              f"{str(exc)[:200]})") from None


# The config.json keys vLLM derives a model's context length from (the smallest present wins), and the
# RoPE types whose max_position_embeddings is already scaled (vLLM applies `factor` to the others).
CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "model_max_length",
                "max_target_positions", "max_sequence_length", "max_seq_length", "seq_len")
PRESCALED_ROPE = ("su", "longrope", "llama3", "yarn", "deepseek_yarn", "deepseek_llama_scaling")


def target_context_length(target_dir: str | os.PathLike) -> tuple[int, str] | None:
    """The longest context the target serves, as vLLM derives it from ``config.json`` (the smallest of
    :data:`CONTEXT_KEYS`, times a RoPE scaling factor), with the key it came from; None if it has none."""
    cfg = json.loads((Path(target_dir) / "config.json").read_text())
    found = [(int(cfg[k]), k) for k in CONTEXT_KEYS if isinstance(cfg.get(k), (int, float)) and cfg[k] > 0]
    if not found:
        return None
    length, key = min(found)
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    params = [rope] if isinstance(rope, dict) and ("rope_type" in rope or "type" in rope) else [
        p for p in (rope.values() if isinstance(rope, dict) else []) if isinstance(p, dict)]
    factor = 1.0
    for p in params:
        if p.get("rope_type", p.get("type")) not in PRESCALED_ROPE and isinstance(p.get("factor"), (int, float)):
            factor = float(p["factor"])
    where = f"{key}={length}" + (f" x rope factor {factor:g}" if factor != 1.0 else "")
    return int(length * factor), f"{where} in {Path(target_dir) / 'config.json'}"


def _longest_prompt(target_dir: str, workloads: list, trust_remote_code: bool) -> tuple[int, str] | None:
    """(tokens, workload and prompt id) of the longest chat prompt as the target's chat template renders it,
    or None when it cannot be rendered here (vLLM then reports it)."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(target_dir, trust_remote_code=trust_remote_code)
        longest, which, seen = 0, "", set()
        for w in workloads:
            for pid, chat in zip(w.prompt_ids, w.chats):
                key = json.dumps(chat, sort_keys=True)
                if key in seen:
                    continue
                seen.add(key)
                text = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
                n = len(tok(text, add_special_tokens=False)["input_ids"])
                if n > longest:
                    longest, which = n, f"prompt {pid!r} of {w.category}"
        return (longest, which) if which else None
    except Exception as exc:  # noqa: BLE001 - e.g. no chat template: vLLM's own error says it better
        log.warning("cannot count the prompts' tokens with %s's tokenizer (%s); max_model_len not fitted to them",
                    target_dir, exc)
        return None


def context_length(settings: EvaluateSettings, target_dir: str, workloads: list,
                   trust_remote_code: bool = False) -> int:
    """The vLLM context length of the offline runs: ``evaluate.engine.max_model_len`` when set, else what
    the longest prompt plus the generated tokens needs (+ :data:`CONTEXT_MARGIN`), at most the target's
    own context length (:func:`target_context_length`). A value above the target's, or one a prompt does
    not fit in, is a ConfigError naming evaluate.engine.max_model_len (vLLM would refuse it only after
    loading the target)."""
    limit = target_context_length(target_dir)
    asked = settings.engine.max_model_len
    if asked is not None and limit is not None and asked > limit[0]:
        raise ConfigError(f"evaluate.engine.max_model_len {asked} exceeds the target's context length "
                          f"{limit[0]} ({limit[1]}); set at most {limit[0]}, or leave it unset to fit the prompts")
    prompt = _longest_prompt(target_dir, workloads, trust_remote_code)
    if asked is not None:
        if prompt is not None and prompt[0] >= asked:
            raise ConfigError(f"evaluate.engine.max_model_len {asked} leaves no room to generate after {prompt[1]}, "
                              f"which has {prompt[0]} tokens; raise it or shorten the prompts")
        return asked
    if prompt is not None and limit is not None and prompt[0] >= limit[0]:
        raise ConfigError(f"{prompt[1]} has {prompt[0]} tokens, no fewer than the target's context length "
                          f"({limit[1]}); shorten the prompts (evaluate.system_prompt, prompt sets)")
    generated = max([w.max_tokens for w in workloads]
                    + ([settings.lossless_check_max_tokens] if settings.lossless_check != "none" else [])
                    + ([settings.speed.max_tokens] if settings.speed.enabled and settings.speed.max_tokens else []),
                    default=settings.max_tokens)
    need = prompt[0] + generated + CONTEXT_MARGIN if prompt is not None else DEFAULT_MAX_MODEL_LEN
    return min(need, limit[0]) if limit is not None else need


def sweep_ks(settings: EvaluateSettings, trained_depths: int | None) -> list[int]:
    """The K values to run (offline mode): ``num_speculative_tokens`` (default 1..the trained depths)
    plus the ``sweep_k`` values within the trained depths; refuses a requested K beyond the trained
    depths unless allowed."""
    if settings.num_speculative_tokens is None:
        if trained_depths is None:
            raise ConfigError("evaluate.num_speculative_tokens is required when the draft's depths are unknown")
        ks = list(range(1, trained_depths + 1))
    else:
        ks = list(settings.num_speculative_tokens)
    if trained_depths is not None and max(ks) > trained_depths and not settings.allow_untrained_depths:
        raise ConfigError(f"evaluate.num_speculative_tokens {ks} exceeds the draft's {trained_depths} trained depths; "
                          "vLLM would serve untrained positions (set evaluate.allow_untrained_depths to do it anyway)")
    limit = trained_depths if trained_depths is not None and not settings.allow_untrained_depths else None
    extra = [k for k in settings.sweep_k if limit is None or k <= limit]
    return sorted(set(ks) | set(extra))


def check_speed_ks(settings: EvaluateSettings, trained_depths: int | None) -> None:
    """Refuse speed K values beyond the draft's trained depths (unless allowed), before any engine starts."""
    asked = settings.speed.num_speculative_tokens
    if (asked and trained_depths is not None and max(asked) > trained_depths
            and not settings.allow_untrained_depths):
        raise ConfigError(f"evaluate.speed.num_speculative_tokens {asked} exceeds the draft's {trained_depths} "
                          "trained depths (set evaluate.allow_untrained_depths to measure them anyway)")


def _offline(settings: EvaluateSettings, target_dir: str, target_fingerprint: str, draft_dir: str, spec,
             num_depths: int) -> dict[str, Any]:
    import torch

    from ..extract import HiddenStatesDataset
    from .offline import offline_agreement

    ds = HiddenStatesDataset(settings.hidden_states, expect_aux_layer_ids=spec.aux_layer_ids,
                             expect_hidden_size=spec.hidden_size, expect_fingerprint=target_fingerprint,
                             out_dtype=torch.float32)
    result = offline_agreement(draft_dir, target_dir, ds, num_depths=num_depths,
                               max_samples=settings.offline_max_samples, device=settings.offline_device)
    return {**result.as_dict(), "hidden_states": settings.hidden_states}


def _endpoint_speed(s: EvaluateSettings, runs: list, workloads: list, out: Path):
    """Speed per load against the draft endpoint and the baseline endpoint (:func:`.speed_sweep.measure_endpoint_speed`)."""
    from ..engine.client import EndpointError
    from .endpoint import client_for, endpoint_model
    from .speed_sweep import measure_endpoint_speed

    k = max(r.num_speculative_tokens for r in runs)
    greedy = [c for w in workloads if w.sampling.greedy for c in w.chats] or [c for w in workloads for c in w.chats]
    try:
        draft_client, base_client = client_for(s, s.endpoint), client_for(s, s.baseline_endpoint)
        return measure_endpoint_speed(s.speed, draft_client=draft_client, baseline_client=base_client,
                                      draft_model=endpoint_model(s, draft_client),
                                      baseline_model=endpoint_model(s, base_client), k=k, chats=greedy,
                                      max_tokens=s.max_tokens, raw_log=out / SPEED_TIMINGS)
    except EndpointError as exc:
        raise EvaluationError(f"the endpoints' speed measurement failed: {exc}") from exc


def evaluate(cfg: EvaluateRunConfig) -> EvaluationOutcome:
    """Run the evaluation described by ``cfg`` and write its report; see :mod:`peagle.evaluate`."""
    from ..model import check_draft_matches_target, inspect_target
    from ..model.target import fingerprint

    s = cfg.evaluate
    out = Path(s.out or Path(cfg.work_dir) / "evaluate")
    prompt_sets = load_prompt_sets(s.prompt_sets, s.prompts_per_category)
    samplings = samplings_of(s)
    workloads = build_workloads(prompt_sets, samplings, s.max_tokens, s.ignore_eos, s.system_prompt,
                                s.timing_repeats)

    # ---- Cheap checks first: target, draft, their match, the K sweep --------------------------
    target_dir = cfg.target.path
    target: dict[str, Any] = {"path": None, "fingerprint": None}
    if target_dir:
        target_info = inspect_target(target_dir, cfg.target.trust_remote_code)
        target = {"path": str(Path(target_dir).resolve()), "fingerprint": fingerprint(target_dir)}
    draft: dict[str, Any] = {"path": None, "sha256": None, "trained_depths": None}
    spec = None
    if s.draft:
        draft, spec = _draft_info(s.draft)
        if target_dir:
            check_draft_matches_target(spec, target_info)
    if not s.endpoint and not (target_dir and s.draft):
        raise ConfigError("offline evaluation needs target.path and evaluate.draft (or evaluate.endpoint)")
    if s.hidden_states and not (target_dir and s.draft):
        raise ConfigError("offline metrics (evaluate.hidden_states) need target.path and evaluate.draft")
    ks = [] if s.endpoint else sweep_ks(s, draft["trained_depths"])
    if ks:
        headline_k(ks, draft["trained_depths"], s.headline_num_speculative_tokens)
    measure_speed_too = bool(ks) and s.speed.enabled and s.measure_baseline
    if measure_speed_too:
        check_speed_ks(s, draft["trained_depths"])
    if not s.endpoint:  # vLLM refuses a context beyond the target's only after loading it
        fitted = context_length(s, target_dir, workloads, cfg.target.trust_remote_code)
        s = s.model_copy(update={"engine": s.engine.model_copy(update={"max_model_len": fitted})})

    # The output, before the measurement (hours): a directory this process can write, apart from the inputs.
    check_not_an_input(Path(os.path.realpath(check_writable(out, directory=True))),
                       [target_dir, s.draft, s.hidden_states], str(out))

    # ---- Offline agreement (no vLLM), before the long live runs so a bad dataset fails early ------
    offline = None
    if s.hidden_states:
        offline = _offline(s, target_dir, target["fingerprint"], s.draft, spec, max([spec.num_depths, *ks]))

    # ---- Live measurement -------------------------------------------------------------------
    if s.endpoint:
        from .endpoint import run_endpoints

        mode = "endpoint"
        try:
            runs = run_endpoints(s, workloads)
        except CounterError as exc:  # e.g. the server restarted during a workload
            raise EvaluationError(f"the endpoint's counters are unusable: {exc}") from exc
        draft["endpoint"] = s.endpoint
        if s.baseline_endpoint:
            target["baseline_endpoint"] = s.baseline_endpoint
    else:
        mode = "offline-api"
        try:
            runs = run_offline_api(s, target_dir, s.draft, ks, workloads, raw_log=out / ENGINE_OUTPUTS)
        except (RuntimeError, OSError) as exc:  # vLLM's own error text is in the message
            raise EvaluationError(f"the vLLM measurement failed: {exc}") from exc

    speed = None
    if s.endpoint and s.speed.enabled and s.baseline_endpoint:
        speed = _endpoint_speed(s, runs, workloads, out)
    if measure_speed_too:
        from .speed_sweep import measure_speed

        greedy = [c for w in workloads if w.sampling.greedy for c in w.chats] or [c for w in workloads for c in w.chats]
        try:
            speed = measure_speed(s.speed, target_dir=target_dir, draft_dir=s.draft, draft_sha256=draft["sha256"],
                                  trained_depths=draft["trained_depths"], engine=s.engine, dtype=s.dtype,
                                  seed=s.seed, chats=greedy, max_tokens=s.max_tokens, raw_log=out / SPEED_TIMINGS)
        except (RuntimeError, OSError) as exc:
            raise EvaluationError(f"the vLLM speed measurement failed: {exc}") from exc

    report = build_report(mode=mode, runs=runs, workloads=workloads, samplings=samplings, prompt_sets=prompt_sets,
                          target=target, draft=draft, headline=s.headline_num_speculative_tokens, offline=offline,
                          settings=json.loads(s.model_dump_json()), speed=speed)
    gate = apply_gate(report, s.min_acceptance_length, s.require_lossless,
                      speed_tolerance=s.speed.tolerance if speed is not None else None,
                      dead_draft_acceptance_length=s.dead_draft_acceptance_length)
    report["gate"] = gate.as_dict()
    paths = write_report(report, out)
    return EvaluationOutcome(report, gate.passed, *paths)


def write_report(report: dict[str, Any], out: str | os.PathLike) -> tuple[Path, Path]:
    """Write report.json and report.html into ``out`` (each atomically), and ``schedule.json`` when the
    report chose a speculation schedule; returns the report's two paths."""
    from ..speed import SCHEDULE_FILE, SpeculationSchedule

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    files = [(REPORT_JSON, json.dumps(report, indent=2) + "\n"), (REPORT_HTML, render_html(report))]
    schedule = (report.get("speed") or {}).get("schedule")
    if schedule is not None:  # the typed stage output serving reads (validated as it is written)
        files.insert(0, (SCHEDULE_FILE, SpeculationSchedule.model_validate(schedule).to_json()))
    for name, text in files:
        p = out / name
        with atomic_path(p, fsync=False) as tmp:
            tmp.write_text(text, encoding="utf-8")
        if name != SCHEDULE_FILE:
            paths.append(p)
    return paths[0], paths[1]


def summary_lines(report: dict[str, Any]) -> list[str]:
    """A few human lines for the terminal."""
    s = report["summary"]
    pos = ", ".join(f"{a:.3f}" for a in s["per_position_acceptance"] or [])
    lines = [f"K={s['num_speculative_tokens']} {s['sampling']['name']}: acceptance length "
             f"{_num(s['acceptance_length'])} (per position {pos or '-'}), speedup {_num(s['speedup'])}"]
    for name, f in (s.get("sets") or {}).items():
        ci = (f.get("confidence") or {}).get("acceptance_length")
        first = (f["per_position_acceptance"] or [None])[0]
        lines.append(f"  set {name:<16} AL {_num(f['acceptance_length'])}"
                     + (f" [{ci[0]:.3f}-{ci[1]:.3f}]" if ci else "") + f"  first position {_num(first)}")
    for cat, f in s["categories"].items():
        lines.append(f"  {cat:<20} AL {_num(f['acceptance_length'])}  speedup {_num(f['speedup'])}")
    for name, curves in report["acceptance_length_vs_k"].items():
        lines.append(f"AL vs K ({name}): " + ", ".join(f"K={k}: {_num(v)}" for k, v in curves["overall"].items()))
    lossless = s.get("lossless")
    if lossless:
        lines.append(f"greedy outputs identical with the draft: {lossless['identical']}/{lossless['compared']}")
    sc = s.get("target_self_consistency")
    if sc:
        lines.append(f"target alone re-batched, identical: {sc['identical']}/{sc['compared']} (the bf16 noise floor)")
    fp32 = s.get("lossless_float32")
    if fp32:
        lines.append(f"float32 check, identical with the draft (K={fp32['num_speculative_tokens']}): "
                     f"{fp32['identical']}/{fp32['compared']}, {fp32['accepted_tokens']} drafted tokens accepted")
    if "offline_expected_acceptance_length" in s:
        lines.append(f"offline chain estimate of AL: {_num(s['offline_expected_acceptance_length'])}")
    return lines


def _num(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}"
