"""Report, HTML page with plots, KFP logging, gate, prompt sets and settings (no vLLM engine here)."""
from __future__ import annotations

import base64
import io
import json
import re
import shutil
import socket
import subprocess
import sys

import numpy as np
import pytest
import yaml

from peagle.config import ConfigError
from peagle.evaluate import (
    EvaluateRunConfig,
    EvaluateSettings,
    apply_gate,
    build_report,
    kfp_scalar_metrics,
    load_prompt_sets,
    log_to_kfp,
    passes_gate,
    render_html,
    write_report,
)
from peagle.evaluate.__main__ import load_config
from peagle.evaluate.__main__ import main as evaluate_main
from peagle.evaluate.counters import SpecDecodeCounts
from peagle.evaluate.live import BASELINE, EngineRun, WorkloadResult, build_workloads, samplings_of
from peagle.evaluate.prompts import BUILTIN_CATEGORIES, PromptSetError
from peagle.evaluate.report import REPORT_FORMAT, Report
from peagle.evaluate.run import sweep_ks

CATEGORIES = ["code", "math", "translation"]


def _per_pos(drafts: int, k: int, p: float) -> list[int]:
    # accepted_at_pos[i] = drafts * p^(i+1): a geometric acceptance curve
    return [int(drafts * p ** (i + 1)) for i in range(k)]


def synthetic_runs(workloads, ks=(1, 2, 4), mismatch: str | None = None) -> list[EngineRun]:
    """Engine runs shaped like the offline-API runner's, with known counts and timings."""
    runs = [EngineRun(BASELINE, {w.name: WorkloadResult(w.name, SpecDecodeCounts(), 64 * len(w.chats), 2.0,
                                                         ["x"] * len(w.chats), [[1, 2, 3]] * len(w.chats))
                                 for w in workloads})]
    for k in ks:
        results = {}
        for i, w in enumerate(workloads):
            p = 0.8 - 0.1 * i if w.sampling.greedy else 0.4
            per_pos = _per_pos(100, k, p)
            ids = [[1, 2, 3]] * len(w.chats)
            if mismatch and w.name == mismatch:
                ids = [[1, 2, 4]] + ids[1:]
            results[w.name] = WorkloadResult(w.name, SpecDecodeCounts(100, 100 * k, sum(per_pos), per_pos),
                                             64 * len(w.chats), 2.0 / (1 + 0.2 * k), ["x"] * len(w.chats), ids)
        runs.append(EngineRun(k, results, engine_start_s=1.0,
                              speculative_config={"method": "eagle3", "parallel_drafting": True,
                                                  "num_speculative_tokens": k}))
    return runs


@pytest.fixture()
def report_parts():
    settings = EvaluateSettings(prompt_sets=CATEGORIES, prompts_per_category=3, temperatures=[0.0, 0.7])
    prompt_sets = load_prompt_sets(settings.prompt_sets, settings.prompts_per_category)
    samplings = samplings_of(settings)
    workloads = build_workloads(prompt_sets, samplings, 64, True)
    return settings, prompt_sets, samplings, workloads


def make_report(report_parts, mismatch=None, offline=None):
    settings, prompt_sets, samplings, workloads = report_parts
    return build_report(mode="offline-api", runs=synthetic_runs(workloads, mismatch=mismatch), workloads=workloads,
                        samplings=samplings, prompt_sets=prompt_sets,
                        target={"path": "/t", "fingerprint": "ab" * 32},
                        draft={"path": "/d", "sha256": "cd" * 32, "trained_depths": 4}, offline=offline)


def test_report_layout_and_figures(report_parts):
    r = make_report(report_parts)
    assert r["format"] == REPORT_FORMAT and r["num_speculative_tokens"] == [1, 2, 4]
    assert [s["name"] for s in r["samplings"]] == ["greedy", "T=0.7"]
    assert len(r["runs"]) == 3 * 2 and set(r["runs"][0]["categories"]) == set(CATEGORIES)
    s = r["summary"]
    assert s["num_speculative_tokens"] == 4 and s["sampling"]["name"] == "greedy"  # trained depths, greedy
    code = next(e for e in r["runs"] if e["num_speculative_tokens"] == 4 and e["sampling"]["name"] == "greedy")
    per_pos = _per_pos(100, 4, 0.8)
    assert code["categories"]["code"]["acceptance_length"] == pytest.approx(1 + sum(per_pos) / 100)
    assert code["categories"]["code"]["per_position_acceptance"] == pytest.approx([a / 100 for a in per_pos])
    overall = code["overall"]
    assert overall["counts"]["drafts"] == 300 and overall["problems"] == []
    assert overall["speedup"] == pytest.approx(1 + 0.2 * 4)  # same tokens, time / 1.8
    assert overall["lossless"] == {"compared": 9, "identical": 9, "mismatched_prompts": []}
    sampled = next(e for e in r["runs"] if e["num_speculative_tokens"] == 4 and e["sampling"]["name"] == "T=0.7")
    assert sampled["overall"]["lossless"] is None  # only greedy outputs must be identical
    assert set(r["acceptance_length_vs_k"]["greedy"]) == {"overall", *CATEGORIES}
    assert list(r["acceptance_length_vs_k"]["greedy"]["overall"]) == ["1", "2", "4"]
    assert r["baseline"]["greedy"]["overall"]["tokens_per_s"] == pytest.approx(64 * 9 / 6.0)
    json.dumps(r)  # serialisable as is


def test_losslessness_names_the_changed_prompt(report_parts):
    r = make_report(report_parts, mismatch="math@greedy")
    lossless = r["summary"]["lossless"]
    assert lossless["identical"] == 8 and lossless["mismatched_prompts"] == ["math-01"]
    gate = apply_gate(r, require_lossless=True)
    assert not gate.passed and "math-01" in gate.reasons[0]
    assert apply_gate(r).passed  # not required: reported only


def test_gate(report_parts):
    r = make_report(report_parts)
    al = r["summary"]["acceptance_length"]
    assert passes_gate(r, None) and passes_gate(r, al) and passes_gate(r, 1.0)
    assert not passes_gate(r, al + 0.01)
    g = apply_gate(r, al + 0.5)
    assert not g.passed and "below the required" in g.reasons[0] and g.acceptance_length == pytest.approx(al)
    r["summary"]["acceptance_length"] = None  # nothing was ever drafted
    assert not passes_gate(r, 1.0)


@pytest.mark.parametrize("edit", [{"passed": True}, {"passed": "false", "reasons": []}, {"passed": 1, "reasons": []}])
def test_a_report_whose_gate_verdict_disagrees_with_its_reasons_is_refused(report_parts, edit):
    from peagle.evaluate.report import ReportError

    r = make_report(report_parts)
    r["gate"] = {**apply_gate(r, r["summary"]["acceptance_length"] + 0.5).as_dict(), **edit}
    with pytest.raises(ReportError, match="report.json: .*gate: field 'passed'"):
        Report.from_doc(r, "report.json")


def test_gate_command_exit_codes(report_parts, tmp_path, capsys, monkeypatch):
    import runpy
    import warnings

    r = make_report(report_parts)
    r["gate"] = apply_gate(r).as_dict()
    path, _ = write_report(r, tmp_path)
    al = r["summary"]["acceptance_length"]
    # the real entry (``python -m peagle.evaluate``: its __main__ block's exit code) once, in-process ...
    monkeypatch.setattr(sys, "argv", ["peagle.evaluate", "--check", str(path),
                                      "--min-acceptance-length", f"{al - 0.1:.3f}"])
    with pytest.raises(SystemExit) as ok, warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # runpy: the module is already imported (by this test)
        runpy.run_module("peagle.evaluate", run_name="__main__", alter_sys=True)
    assert ok.value.code == 0, capsys.readouterr()
    # ... and main() for the other outcomes
    assert evaluate_main(["--check", str(path), "--min-acceptance-length", f"{al + 0.1:.3f}"]) == 1
    assert "below the required" in capsys.readouterr().out
    assert evaluate_main(["--check", str(path), "--min-acceptance-length", "0.5"]) == 2  # a bar below 1 is invalid
    assert "min_acceptance_length" in capsys.readouterr().err


def _pngs(page: str) -> dict[str, bytes]:
    return {m.group(1): base64.b64decode(m.group(2))
            for m in re.finditer(r'<img id="plot-([a-z_]+)"[^>]*src="data:image/png;base64,([^"]+)"', page)}


def _check_png(png: bytes) -> None:
    from matplotlib.image import imread

    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    img = imread(io.BytesIO(png), format="png")
    h, w = img.shape[:2]
    assert w >= 600 and h >= 300
    rgb = img[..., :3]
    non_white = (rgb < 0.95).any(axis=-1).mean()
    assert 0.01 < non_white < 0.6, non_white  # drawn on, but not a solid block
    assert len(np.unique(rgb.reshape(-1, 3), axis=0)) > 20  # lines, text and colours, not a blank canvas


def test_html_report_embeds_the_plots(report_parts, tmp_path):
    offline = {"num_depths": 4, "num_samples": 5, "num_anchors": 100,
               "per_depth_agreement": [0.8, 0.5, 0.3, 0.2], "per_depth_count": [100, 90, 80, 70],
               "conditional_agreement": [0.8, 0.55, 0.5, 0.4], "prefix_agreement": [0.8, 0.44, 0.22, 0.088],
               "expected_acceptance_length": {"1": 1.8, "2": 2.24, "3": 2.46, "4": 2.548}}
    r = make_report(report_parts, offline=offline)
    r["gate"] = apply_gate(r, 1.5).as_dict()
    json_path, html_path = write_report(r, tmp_path)
    assert json.loads(json_path.read_text())["summary"] == r["summary"]
    page = html_path.read_text()
    pngs = _pngs(page)
    assert set(pngs) == {"per_position_acceptance", "acceptance_length_vs_k", "speedup_vs_k", "offline_agreement"}
    for png in pngs.values():
        _check_png(png)
    for cat in CATEGORIES:
        assert f"<td>{cat}</td>" in page
    assert "passed" in page and "ab" * 32 in page and "cd" * 32 in page
    assert "<script" not in page  # self-contained and inert (KFP's viewer sandboxes it anyway)
    # Without a baseline or offline data the page still renders, with the two core plots.
    settings, prompt_sets, samplings, workloads = report_parts
    bare = build_report(mode="endpoint", runs=synthetic_runs(workloads, ks=(4,))[1:], workloads=workloads,
                        samplings=samplings, prompt_sets=prompt_sets, target={}, draft={})
    bare_page = render_html(bare)
    # one K: no plot against K (a single point is no curve), and the page says why
    assert set(_pngs(bare_page)) == {"per_position_acceptance"} and "One K was measured" in bare_page
    assert bare["summary"]["speedup"] is None and bare["baseline"] is None


def test_html_renders_in_headless_chromium(report_parts, tmp_path):
    browser = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if browser is None:
        pytest.skip("no chromium on this machine")
    _, html_path = write_report(make_report(report_parts), tmp_path)
    shot = tmp_path / "shot.png"
    proc = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                           f"--screenshot={shot}", "--window-size=1200,2400", html_path.as_uri()],
                          capture_output=True, text=True, timeout=120)
    assert shot.is_file(), proc.stderr[-2000:]
    _check_png(shot.read_bytes())


def test_kfp_artifacts(report_parts, tmp_path):
    from kfp import dsl

    r = make_report(report_parts)
    r["gate"] = apply_gate(r, 1.2).as_dict()
    metrics = dsl.Metrics(uri=str(tmp_path / "metrics"))
    page = dsl.HTML(uri=str(tmp_path / "page.html"))
    scalars = log_to_kfp(Report.from_doc(r), metrics=metrics, html=page)
    assert metrics.metadata == scalars
    assert scalars["acceptance_length"] == pytest.approx(r["summary"]["acceptance_length"])
    assert scalars["num_speculative_tokens"] == 4.0 and scalars["gate_passed"] == 1.0
    assert {f"acceptance_length_{c}" for c in CATEGORIES} <= set(scalars)
    assert scalars["acceptance_position_0"] == pytest.approx(r["summary"]["per_position_acceptance"][0])
    assert all(isinstance(v, float) for v in scalars.values())
    assert all(re.fullmatch(r"[a-z][a-z0-9_]*", name) for name in scalars), sorted(scalars)
    assert "acceptance_length_k4_t_0_7" in scalars and "acceptance_length_k2_greedy" in scalars
    assert set(_pngs((tmp_path / "page.html").read_text())) >= {"per_position_acceptance", "acceptance_length_vs_k"}
    # plain paths work the same way
    log_to_kfp(Report.from_doc(r), metrics=tmp_path / "m.json", html=tmp_path / "p.html")
    assert json.loads((tmp_path / "m.json").read_text()) == kfp_scalar_metrics(Report.from_doc(r))
    assert (tmp_path / "p.html").read_text().startswith("<!DOCTYPE html>")


def test_builtin_prompt_sets_and_mtbench(tmp_path):
    sets = load_prompt_sets(list(BUILTIN_CATEGORIES))
    assert list(sets) == ["code", "math", "summarization", "qa", "translation", "writing"]
    for cat, ps in sets.items():
        assert 8 <= len(ps.prompts) <= 12, cat
        assert len({p.id for p in ps.prompts}) == len(ps.prompts)
        assert all(p.messages[-1]["role"] == "user" and len(p.messages[-1]["content"]) > 20 for p in ps.prompts)
    assert load_prompt_sets(["math"], per_category=2)["math"].prompts[1].id == "math-02"
    mt = load_prompt_sets(["mtbench"])
    assert len(mt) == 8 and all(len(ps.prompts) == 10 for ps in mt.values())
    assert "Apache-2.0" in mt["mtbench-coding"].attribution
    assert list(load_prompt_sets(["mtbench:math"])) == ["mtbench-math"]
    own = tmp_path / "mine.jsonl"
    own.write_text(json.dumps({"prompt": "hello there"}) + "\n" + json.dumps(
        {"category": "chat", "messages": [{"role": "system", "content": "be brief"},
                                          {"role": "user", "content": "hi"}]}) + "\n")
    mine = load_prompt_sets([str(own)])
    assert set(mine) == {"mine", "chat"} and mine["chat"].prompts[0].chat("ignored")[0]["content"] == "be brief"
    assert mine["mine"].prompts[0].chat("sys") == [{"role": "system", "content": "sys"},
                                                    {"role": "user", "content": "hello there"}]
    for bad in (["nope"], ["code", "code"], [str(tmp_path / "missing.jsonl")], []):
        with pytest.raises(PromptSetError):
            load_prompt_sets(bad)


def test_settings_and_config(tmp_path):
    run_yaml = tmp_path / "run.yaml"
    run_yaml.write_text(yaml.safe_dump({
        "target": {"path": "/models/t"}, "draft": {"num_depths": 6}, "train": {"lr": 1e-3},  # other stages: ignored
        "evaluate": {"draft": "/models/d", "num_speculative_tokens": [4, 2, 2], "temperatures": [0, 0.7]}}))
    cfg = load_config(str(run_yaml), ["evaluate.max_tokens=64"], {"evaluate.min_acceptance_length": 2.0})
    assert isinstance(cfg, EvaluateRunConfig)
    e = cfg.evaluate
    assert cfg.target.path == "/models/t" and e.num_speculative_tokens == [2, 4] and e.max_tokens == 64
    assert e.min_acceptance_length == 2.0
    with pytest.raises(ConfigError, match="evaluate.bogus"):
        load_config(str(run_yaml), ["evaluate.bogus=1"], {})
    with pytest.raises(ConfigError, match="temperatures"):
        load_config(None, ["evaluate.temperatures=[-1]"], {})
    assert sweep_ks(EvaluateSettings(), 4) == [1, 2, 3, 4]
    assert sweep_ks(EvaluateSettings(num_speculative_tokens=[2, 3]), 4) == [2, 3]
    with pytest.raises(ConfigError, match="trained depths"):
        sweep_ks(EvaluateSettings(num_speculative_tokens=[8]), 4)
    assert sweep_ks(EvaluateSettings(num_speculative_tokens=[8], allow_untrained_depths=True), 4) == [8]


def test_command_refuses_bad_input_and_reports_a_failed_measurement(tmp_path, qwen3_target, capsys, monkeypatch):
    import types

    from peagle.engine import client

    waits: list[float] = []  # the client's backoff between tries (5.4 s of sleeping): recorded, not slept
    monkeypatch.setattr(client, "time", types.SimpleNamespace(sleep=waits.append))

    def run(*args):
        code = evaluate_main(["--out", str(tmp_path / "out"), *args])
        return code, capsys.readouterr().err

    code, err = run("--target", str(qwen3_target))
    assert code == 2 and "evaluate.draft" in err
    code, err = run("--target", str(qwen3_target), "--draft", str(tmp_path), "--prompt-sets", "poetry")
    assert code == 2 and "unknown prompt set 'poetry'" in err
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code, err = run("--endpoint", f"http://127.0.0.1:{port}", "--request-timeout-s", "5")
    assert code == 3 and f"127.0.0.1:{port}" in err
    assert len(waits) == 4 and "after 5 tries" in err  # retried, then reported as a failed measurement
    assert not (tmp_path / "out" / "report.json").exists()


@pytest.mark.parametrize("where", ["a_file", "inside_the_draft"])
def test_command_refuses_an_out_it_cannot_or_must_not_write_before_measuring(tmp_path, qwen3_target, capsys, where):
    from peagle.cli import main as peagle_main

    draft = tmp_path / "draft"
    assert peagle_main(["draft", "init", "--target", str(qwen3_target), "--out", str(draft), "--num-depths", "2",
                        "--draft-vocab-size", "128", "--aux-layer-ids", "1", "3", "5"]) == 0
    (tmp_path / "a_file").write_text("mine")
    out = tmp_path / "a_file" if where == "a_file" else draft / "evaluate"
    code = evaluate_main(["--out", str(out), "--target", str(qwen3_target), "--draft", str(draft),
                          "--endpoint", "http://127.0.0.1:9"])
    assert code == 2 and str(out) in capsys.readouterr().err
    assert (tmp_path / "a_file").read_text() == "mine" and not (draft / "evaluate").exists()


def test_confidence_intervals_reach_report_json_the_page_and_kfp(report_parts, tmp_path):
    """Per-request histograms -> bootstrap intervals in report.json, the HTML and the KFP scalars."""
    from peagle.evaluate import log_to_kfp
    from peagle.evaluate.html_report import render_html

    settings, prompt_sets, samplings, workloads = report_parts
    runs = synthetic_runs(workloads)
    rng = np.random.default_rng(0)
    for run in runs[1:]:
        for w in workloads:
            run.results[w.name].acceptance_histograms = [
                list(rng.integers(0, 5, size=run.num_speculative_tokens + 1)) for _ in w.chats]
    r = build_report(mode="offline-api", runs=runs, workloads=workloads, samplings=samplings, prompt_sets=prompt_sets,
                     target={"path": "/t", "fingerprint": "ab" * 32},
                     draft={"path": "/d", "sha256": "cd" * 32, "trained_depths": 4})
    ci = r["summary"]["confidence"]
    assert ci["requests"] == 9 and len(ci["per_position_acceptance"]) == 4
    assert ci["acceptance_length"][0] < ci["acceptance_length"][1]
    assert len(r["summary"]["conditional_acceptance"]) == 4
    json.dumps(r)
    page = render_html(r)
    assert "95% bootstrap intervals over the 9 prompts" in page and "conditional acceptance" in page
    scalars = log_to_kfp(Report.from_doc(r), metrics=tmp_path / "m.json")
    assert scalars["acceptance_length_ci_low"] == ci["acceptance_length"][0]
    assert scalars["acceptance_position_0_ci_high"] == ci["per_position_acceptance"][0][1]
    assert "conditional_acceptance_position_1" in scalars
    assert make_report(report_parts)["summary"]["confidence"] is None  # no histograms: no interval, not a guess


def test_k_sweep_adds_k_values_within_the_trained_depths():
    s = EvaluateSettings(num_speculative_tokens=[4], sweep_k=[2, 1, 2, 8])
    assert s.sweep_k == [1, 2, 8]
    assert sweep_ks(s, 4) == [1, 2, 4]  # 8 is beyond the draft's depths: left out, not refused
    assert sweep_ks(EvaluateSettings(num_speculative_tokens=[4], sweep_k=[8], allow_untrained_depths=True), 4) == [4, 8]
    assert sweep_ks(EvaluateSettings(sweep_k=[1]), 3) == [1, 2, 3]
    with pytest.raises(ValueError, match="sweep_k"):
        EvaluateSettings(sweep_k=[0])


def test_single_k_without_baseline_draws_no_speedup_or_k_plots(report_parts):
    from peagle.evaluate.plots import render_plots

    settings, prompt_sets, samplings, workloads = report_parts
    one = build_report(mode="offline-api", runs=synthetic_runs(workloads, ks=(4,)), workloads=workloads,
                       samplings=samplings, prompt_sets=prompt_sets, target={}, draft={"trained_depths": 4})
    assert set(render_plots(one)) == {"per_position_acceptance"}
    two = build_report(mode="offline-api", runs=synthetic_runs(workloads, ks=(2, 4)), workloads=workloads,
                       samplings=samplings, prompt_sets=prompt_sets, target={}, draft={"trained_depths": 4})
    assert set(render_plots(two)) == {"per_position_acceptance", "acceptance_length_vs_k", "speedup_vs_k"}


def test_report_has_figures_and_intervals_per_prompt_set(tmp_path):
    """Held-out ShareGPT + MT-Bench per category: report.json pools each set's categories, with CIs."""
    settings = EvaluateSettings(prompt_sets=["sharegpt-heldout@6", "mtbench@2"], temperatures=[0.0])
    prompt_sets = load_prompt_sets(settings.prompt_sets)
    assert len(prompt_sets["sharegpt-heldout"].prompts) == 6 and len(prompt_sets) == 1 + 8
    samplings = samplings_of(settings)
    workloads = build_workloads(prompt_sets, samplings, 64, True)
    runs = synthetic_runs(workloads, ks=(1, 2, 4))
    rng = np.random.default_rng(1)
    for run in runs[1:]:
        for w in workloads:
            run.results[w.name].acceptance_histograms = [
                list(rng.integers(0, 5, size=run.num_speculative_tokens + 1)) for _ in w.chats]
    r = build_report(mode="offline-api", runs=runs, workloads=workloads, samplings=samplings, prompt_sets=prompt_sets,
                     target={}, draft={"trained_depths": 4})
    assert r["prompt_sets"]["mtbench-math"]["set"] == "mtbench"
    sets = r["summary"]["sets"]
    assert list(sets) == ["sharegpt-heldout", "mtbench"]
    assert sets["sharegpt-heldout"]["categories"] == ["sharegpt-heldout"]
    assert len(sets["mtbench"]["categories"]) == 8
    assert sets["mtbench"]["confidence"]["requests"] == 16 and sets["sharegpt-heldout"]["confidence"]["requests"] == 6
    lo, hi = sets["mtbench"]["confidence"]["acceptance_length"]
    assert 1.0 <= lo < hi <= 5.0  # (the synthetic histograms are random, not the counters' own)
    # the set's figure is its categories' counts pooled
    entry = next(e for e in r["runs"] if e["num_speculative_tokens"] == 4)
    drafts = sum(entry["categories"][c]["counts"]["drafts"] for c in sets["mtbench"]["categories"])
    assert entry["sets"]["mtbench"]["counts"]["drafts"] == drafts
    scalars = kfp_scalar_metrics(Report.from_doc(r))
    assert scalars["acceptance_length_set_mtbench"] == sets["mtbench"]["acceptance_length"]
    assert scalars["acceptance_length_set_sharegpt_heldout_ci_low"] == sets["sharegpt-heldout"]["confidence"][
        "acceptance_length"][0]
    page = render_html(r)
    assert "Per prompt set" in page and "<td>mtbench</td>" in page and "ever read for training" in page


def test_prompt_set_counts_after_at():
    assert len(load_prompt_sets(["math@2"])["math"].prompts) == 2
    assert len(load_prompt_sets(["math@2"], per_category=1)["math"].prompts) == 1  # the smaller wins
    with pytest.raises(PromptSetError, match="positive integer"):
        load_prompt_sets(["math@x"])
    with pytest.raises(PromptSetError, match="positive integer"):
        load_prompt_sets(["math@0"])


# ---- the command verifies the draft and fits the context to the target, before vLLM starts ----------------
# (folded from test_probe2_pipeline by h3)


@pytest.fixture
def draft_dir(ladder_init_draft):
    """A published draft of the target (the session ladder's: shared, never modified here; the tests copy it)."""
    return ladder_init_draft


@pytest.fixture
def no_vllm(monkeypatch):
    """vLLM cannot run in a unit test; record what evaluate would have started it with."""
    started = []

    def fake(settings, target_dir, draft_dir, ks, workloads, raw_log=None):
        started.append(settings)
        from peagle.evaluate.run import EvaluationError

        raise EvaluationError("vLLM not started in this test")

    monkeypatch.setattr("peagle.evaluate.run.run_offline_api", fake)
    return started


def run_evaluate(capsys, target, draft, out, *extra) -> tuple[int, str]:
    from peagle.evaluate.__main__ import main

    code = main(["--target", str(target), "--draft", str(draft), "--out", str(out), "--prompt-sets", "code",
                 "--prompts-per-category", "1", "--temperatures", "0", "--max-tokens", "8", *extra])
    return code, capsys.readouterr().err


def _copy(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_evaluate_refuses_a_bit_flipped_draft_before_vllm(capsys, qwen3_target, draft_dir, tmp_path, no_vllm):
    bad = _copy(draft_dir, tmp_path / "flipped")
    weights = bad / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-7] ^= 0x10  # a weight's bit, same size: only the checksum can tell
    weights.write_bytes(bytes(data))
    code, err = run_evaluate(capsys, qwen3_target, bad, tmp_path / "out")
    assert code == 2 and "model.safetensors" in err and "Traceback" not in err, err
    assert no_vllm == []


def test_evaluate_refuses_a_draft_missing_a_published_file(capsys, qwen3_target, draft_dir, tmp_path, no_vllm):
    bad = _copy(draft_dir, tmp_path / "short")
    (bad / "model.safetensors").write_bytes((bad / "model.safetensors").read_bytes()[:-8])
    code, err = run_evaluate(capsys, qwen3_target, bad, tmp_path / "out")
    assert code == 2 and "model.safetensors" in err, err
    assert no_vllm == []


def _nan_weights(d) -> str:
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(d / "model.safetensors"))
    name = sorted(n for n, t in tensors.items() if t.is_floating_point())[0]
    tensors[name].view(-1)[3] = float("nan")
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    return name


def test_evaluate_refuses_a_published_draft_with_nan_weights(capsys, qwen3_target, draft_dir, tmp_path, no_vllm):
    from peagle.storage import LocalStore, open_published, publish_dir

    bad = _copy(draft_dir, tmp_path / "nan")
    meta = dict(open_published(LocalStore(bad), "").manifest.metadata)
    name = _nan_weights(bad)
    publish_dir(LocalStore(bad), "", bad, meta, overwrite=True)  # checksums match the NaN weights
    code, err = run_evaluate(capsys, qwen3_target, bad, tmp_path / "out")
    assert code == 2 and name in err and "model.safetensors" in err and "NaN" in err, err
    assert no_vllm == []


def test_an_unpublished_draft_is_checked_for_finite_weights_and_said_unverified(capsys, caplog, qwen3_target,
                                                                                 draft_dir, tmp_path, no_vllm):
    plain = _copy(draft_dir, tmp_path / "plain")
    for f in ("_MANIFEST.json", "_SUCCESS"):
        (plain / f).unlink()
    code, err = run_evaluate(capsys, qwen3_target, plain, tmp_path / "out")
    assert code == 3 and len(no_vllm) == 1, err  # it got as far as vLLM
    assert "not checksum-verified" in caplog.text
    name = _nan_weights(plain)
    code, err = run_evaluate(capsys, qwen3_target, plain, tmp_path / "out2")
    assert code == 2 and name in err, err
    assert len(no_vllm) == 1


def test_a_published_draft_reaches_vllm(capsys, caplog, qwen3_target, draft_dir, tmp_path, no_vllm):
    code, err = run_evaluate(capsys, qwen3_target, draft_dir, tmp_path / "out")
    assert code == 3 and len(no_vllm) == 1 and "not checksum-verified" not in caplog.text, err


def test_max_model_len_defaults_to_what_fits_the_target_and_the_prompts(capsys, qwen3_target, draft_dir, tmp_path,
                                                                         no_vllm):
    limit = json.loads((qwen3_target / "config.json").read_text())["max_position_embeddings"]
    assert limit == 2048
    code, err = run_evaluate(capsys, qwen3_target, draft_dir, tmp_path / "out")
    assert code == 3, err
    derived = no_vllm[-1].engine.max_model_len
    assert 8 < derived <= limit  # the prompt plus the 8 generated tokens, within the target
    code, err = run_evaluate(capsys, qwen3_target, draft_dir, tmp_path / "out", "--max-tokens", "5000")
    assert code == 3 and no_vllm[-1].engine.max_model_len == limit, err
    code, err = run_evaluate(capsys, qwen3_target, draft_dir, tmp_path / "out", "--engine-max-model-len", "1024")
    assert code == 3 and no_vllm[-1].engine.max_model_len == 1024, err


def test_max_model_len_above_the_target_is_refused_naming_it(capsys, qwen3_target, draft_dir, tmp_path, no_vllm):
    n = len(no_vllm)
    code, err = run_evaluate(capsys, qwen3_target, draft_dir, tmp_path / "out", "--engine-max-model-len", "4096")
    assert code == 2 and "evaluate.engine.max_model_len" in err and "2048" in err, err
    assert len(no_vllm) == n


def test_max_model_len_too_short_for_a_prompt_is_refused(capsys, qwen3_target, draft_dir, tmp_path, no_vllm):
    code, err = run_evaluate(capsys, qwen3_target, draft_dir, tmp_path / "out", "--engine-max-model-len", "16",
                         "--system-prompt", "word " * 40)
    assert code == 2 and "evaluate.engine.max_model_len" in err, err
    assert no_vllm == []
