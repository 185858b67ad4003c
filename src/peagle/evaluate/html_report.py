"""``report.html``: one self-contained page (plots embedded as base64 PNG, no scripts, no fetches),
readable in a browser and in the Kubeflow Pipelines HTML artifact viewer."""
from __future__ import annotations

import base64
import html
import re
from typing import Any

from .plots import render_plots

PLOT_TITLES = {
    "per_position_acceptance": "Acceptance per draft position (per prompt set, or per category with one set); "
                               "bars: 95% bootstrap intervals over prompts",
    "acceptance_length_vs_k": "Acceptance length vs K (one engine per K, same prompts)",
    "speedup_vs_k": "Throughput speedup vs K",
    "offline_agreement": "Offline agreement on held-out hidden states",
    "speedup_vs_concurrency": "Speed per load: tokens/s over the target alone's against requests in flight, one "
                              "line per K and the chosen schedule as served; bars: 95% bootstrap intervals",
}

CSS = """
body { font-family: system-ui, sans-serif; margin: 24px; color: #222; max-width: 1100px; }
table { border-collapse: collapse; margin: 8px 0 20px; font-size: 14px; }
th, td { border: 1px solid #ccc; padding: 4px 8px; text-align: right; }
th:first-child, td:first-child { text-align: left; }
th { background: #f3f3f3; }
.pass { color: #0a7a2a; font-weight: bold; } .fail { color: #b00020; font-weight: bold; }
.ci { color: #666; font-size: 12px; }
code { background: #f6f6f6; padding: 1px 4px; }
figure { margin: 0 0 24px; } figcaption { font-size: 13px; color: #555; }
p.note { font-size: 13px; color: #444; max-width: 900px; }
td.text { text-align: left; }
"""


def _fmt(v: Any, digits: int = 3) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return html.escape(str(v))


def _pct_list(vals: list[float | None] | None) -> str:
    return " / ".join("–" if v is None else f"{100 * v:.1f}" for v in vals) if vals else "–"


def _interval(bounds: list[float] | None, pct: bool = False) -> str:
    if not bounds:
        return ""
    lo, hi = (100 * b for b in bounds) if pct else bounds
    return f" <span class='ci'>[{lo:.1f}–{hi:.1f}]</span>" if pct else f" <span class='ci'>[{lo:.3f}–{hi:.3f}]</span>"


def _pct_ci_list(vals: list[float | None] | None, cis: list | None) -> str:
    if not vals:
        return "–"
    cis = cis or [None] * len(vals)
    return " / ".join(("–" if v is None else f"{100 * v:.1f}") + _interval(b, pct=True) for v, b in zip(vals, cis))


def _lossless(counts: dict[str, Any] | None) -> str:
    if not counts:
        return "–"
    cls = "pass" if counts["identical"] == counts["compared"] else "fail"
    return f'<span class="{cls}">{counts["identical"]}/{counts["compared"]}</span>'


def _align(cell: str) -> str:
    text = re.sub(r"<[^>]+>", "", cell).strip()
    return " class='text'" if len(text) > 24 and not text[:1].isdigit() else ""


def _count(counts: dict[str, Any] | None) -> str:
    """identical/compared without a verdict (bf16 differences can be noise; the float32 check decides)."""
    return f'{counts["identical"]}/{counts["compared"]}' if counts else "–"


def _table(headers: list[str], rows: list[list[str]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    # a cell starting with a letter or a tag is text (left), a number right
    body = "".join("<tr>" + "".join(f"<td{_align(c)}>{c}</td>" for c in row) + "</tr>" for row in rows)
    thead = f"<thead><tr>{head}</tr></thead>" if any(headers) else ""
    return f"<table>{thead}<tbody>{body}</tbody></table>"


def _sampling(sampling: dict[str, Any]) -> str:
    if sampling.get("temperature") == 0:
        return "greedy (temperature 0)"
    return html.escape(f"temperature {sampling['temperature']:g}, top-p {sampling['top_p']:g}, seed {sampling['seed']}")


def _prompt_counts(report: dict[str, Any]) -> str:
    by_set: dict[str, int] = {}
    for c, p in (report.get("prompt_sets") or {}).items():
        by_set[p.get("set") or c] = by_set.get(p.get("set") or c, 0) + p["count"]
    total = sum(by_set.values())
    return f"{total}: " + ", ".join(f"{html.escape(k)} {v}" for k, v in by_set.items()) if by_set else "–"


def _identity_section(s: dict[str, Any]) -> list[str]:
    """'Does the draft change the output?' in plain words: the float32 check decides; the bf16 rows
    are compared with how often the target alone repeats itself."""
    lossless, sc, fp32 = s.get("lossless"), s.get("target_self_consistency"), s.get("lossless_float32")
    if not (lossless or sc or fp32):
        return []
    rows = []
    if fp32:
        ok = fp32["identical"] == fp32["compared"]
        rows.append([f"<b>float32</b>: target alone vs target + draft (K={fp32['num_speculative_tokens']}), "
                     f"same batch", _lossless(fp32),
                     ("lossless: the draft changed no token" if ok else "<b>a real mismatch</b>: in float32 the "
                      "draft must not change the output") + f" <span class='ci'>({fp32['accepted_tokens']} drafted "
                     "tokens accepted)</span>"])
    if lossless:
        rows.append(["bf16: target alone vs target + draft, same batches",
                     _count(lossless),  # not pass/fail: see the noise floor
                     "differences here can be rounding noise (see the next row)"])
    if sc:
        rows.append(["bf16: target alone vs target alone, prompts batched differently",
                     f'{sc["identical"]}/{sc["compared"]}',
                     "the noise floor: the target alone does not repeat itself exactly"])
    out = ["<h2>Does the draft change the output?</h2>",
           _table(["comparison (greedy)", "identical outputs", "what it means"], rows),
           "<p class='note'>Speculative decoding must give exactly the tokens the target would give alone. In "
           "bf16 on CPU that cannot be read off directly: the target alone already produces different greedy "
           "outputs when the same prompts are batched differently, because bf16 rounding depends on the batch "
           "shape and one flipped token changes the rest of the reply. So a bf16 difference with the draft is no "
           "evidence of a bug by itself; compare it with the target's own rate. The float32 check decides: with "
           "rounding noise far smaller, the target alone and the target with the draft must agree token for "
           "token.</p>"]
    return out


def _speed_section(report: dict[str, Any]) -> list[str]:
    """Speed per load: the schedule chosen and, per configuration and concurrency, tokens/s, the ratio to
    the target alone with its interval, TPOT and TTFT (p50 / p90)."""
    speed = report.get("speed")
    if not speed:
        return []
    table, sched = speed["table"], speed["schedule"]
    head = (report["summary"].get("speed") or {})
    out = ["<h2>Speed per load</h2>",
           f"<p>Chosen schedule (batch size: K): <b>{html.escape(head.get('schedule', ''))}</b>"
           + ("" if head.get("serves_draft", True) else " &mdash; the draft wins at no measured load: serve the "
              "target alone") + f". Rule: {html.escape(sched['rule'])}.</p>"]

    def ratio(r: dict[str, Any] | None) -> str:
        return "–" if not r else f"{r['value']:.3f} [{r['low']:.3f}–{r['high']:.3f}]"

    def q(d: dict[str, Any], scale: float = 1000.0) -> str:
        return "–" if d.get("p50") is None else f"{d['p50'] * scale:.1f} / {d['p90'] * scale:.1f}"

    out.append(_table(["configuration", "concurrency", "requests", "tokens/s", "× target alone [95%]",
                       "TPOT ms p50 / p90", "TTFT ms p50 / p90", "latency s p50 / p90"],
                      [[html.escape(p["config"]), _fmt(p["concurrency"]), _fmt(p["requests"]),
                        _fmt(p["tokens_per_s"], 1), ratio(p["speedup"]), q(p["tpot_s"]), q(p["ttft_s"]),
                        q(p["e2e_s"], 1.0)] for p in table["points"]]))
    clocked = [p for p in table["points"] if p.get("step")]
    if clocked:
        def ms(x: float) -> str:
            return f"{x * 1000:.1f}"

        out.append("<h3>Where an engine step's time goes</h3>")
        out.append(_table(["configuration", "concurrency", "step ms", "target forward ms", "sampling + verification ms",
                           "draft ms", "other ms", "tokens / step"],
                          [[html.escape(p["config"]), _fmt(p["concurrency"]), ms(p["step"]["step_s"]),
                            ms(p["step"]["target_s"]), ms(p["step"]["sample_s"]), ms(p["step"]["draft_s"]),
                            ms(p["step"]["other_s"]), _fmt(p["step"]["tokens_per_step"], 2)] for p in clocked]))
        out.append("<p class='note'>Mean per engine step, clocked inside the in-process engine. Target forward: "
                   "with a draft, the verification of each request's drafted tokens. Draft: its forward at every "
                   "step, K = 0 included (vLLM keeps the draft's cache in step). Other: scheduling, input "
                   "preparation, output processing.</p>")
    out.append(f"<p class='note'>{table['rounds']} round(s), configurations in alternating order; "
               f"{table['prompts']} prompts, {table['max_tokens']} tokens each, greedy; requests kept c at a time "
               "(closed loop). Throughput = c &times; output tokens / latency over the requests that ran with c "
               "in flight; intervals resample those requests.</p>")
    return out


def render_html(report: dict[str, Any], plots: dict[str, bytes] | None = None) -> str:
    """The page for ``report`` (plots rendered here unless given)."""
    plots = render_plots(report) if plots is None else plots
    s = report["summary"]
    gate = report.get("gate")
    parts = [f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>P-EAGLE evaluation</title>"
             f"<style>{CSS}</style></head><body>", "<h1>P-EAGLE draft evaluation</h1>"]

    ci = s.get("confidence") or {}
    parts.append("<h2>Summary</h2>")
    rows = [["mode", _fmt(report["mode"])], ["device", _fmt(report.get("device"))],
            ["K (num_speculative_tokens)", _fmt(s["num_speculative_tokens"])],
            ["sampling", _sampling(s["sampling"])],
            ["prompts", _prompt_counts(report)],
            ["acceptance length (tokens per target step)", _fmt(s["acceptance_length"]) + _interval(
                ci.get("acceptance_length"))],
            ["per-position acceptance (%)", _pct_ci_list(s["per_position_acceptance"], ci.get("per_position_acceptance"))],
            ["conditional acceptance (%): at i given i−1", _pct_ci_list(s.get("conditional_acceptance"),
                                                                         ci.get("conditional_acceptance"))],
            ["speedup (tokens/s ratio)", _fmt(s["speedup"])]]
    if gate:
        verdict = '<span class="pass">passed</span>' if gate["passed"] else '<span class="fail">FAILED</span>'
        detail = "; ".join(html.escape(r) for r in gate["reasons"])
        rows.append(["gate", f"{verdict} (min AL {_fmt(gate['min_acceptance_length'])}) {detail}"])
    parts.append(_table(["", ""], rows))
    if ci:
        parts.append(f"<p class='note'>[brackets]: {int(ci['level'] * 100)}% bootstrap intervals over the "
                     f"{ci['requests']} prompts ({ci['resamples']} resamples of vLLM's per-request acceptance "
                     "histograms): how much the figure would move with another draw of prompts like these.</p>")

    sets = s.get("sets") or {}
    if sets:
        parts.append(f"<h2>Per prompt set (K={s['num_speculative_tokens']}, {html.escape(s['sampling']['name'])})</h2>")
        counts = report.get("prompt_sets") or {}
        def first(f: dict[str, Any]) -> str:
            vals = f["per_position_acceptance"] or []
            bounds = ((f.get("confidence") or {}).get("per_position_acceptance") or [None])[0]
            return _pct_ci_list(vals[:1], [bounds]) if vals else "–"

        parts.append(_table(
            ["set", "prompts", "acceptance length", "first-position acceptance (%)", "per-position acceptance (%)",
             "conditional acceptance (%)", "speedup"],
            [[html.escape(g), _fmt(sum((counts.get(c) or {}).get("count", 0) for c in f.get("categories", []))),
              _fmt(f["acceptance_length"]) + _interval((f.get("confidence") or {}).get("acceptance_length")),
              first(f), _pct_list(f["per_position_acceptance"]), _pct_list(f.get("conditional_acceptance")),
              _fmt(f["speedup"])]
             for g, f in sets.items()]))
        if "sharegpt-heldout" in sets:
            parts.append("<p class='note'><b>sharegpt-heldout</b>: first turns of ShareGPT conversations that no "
                         "stage of the pipeline ever read for training (a fixed hash of the conversation id; the "
                         "data source withholds them from prepare and regenerate). <b>mtbench</b>: the MT-Bench "
                         "questions, a different distribution from the training data.</p>")

    parts.append(f"<h2>Per category (K={s['num_speculative_tokens']}, {html.escape(s['sampling']['name'])})</h2>")
    parts.append(_table(["category", "acceptance length", "per-position acceptance (%)", "tokens/s", "baseline tokens/s",
                         "speedup"],
                        [[html.escape(c), _fmt(f["acceptance_length"]) + _interval(
                            (f.get("confidence") or {}).get("acceptance_length")),
                          _pct_list(f["per_position_acceptance"]),
                          _fmt(f["tokens_per_s"], 1), _fmt(f["baseline_tokens_per_s"], 1), _fmt(f["speedup"])]
                         for c, f in s["categories"].items()]))

    parts.extend(_identity_section(s))
    parts.extend(_speed_section(report))

    parts.append("<h2>All runs</h2>")
    parts.append(_table(["K", "sampling", "acceptance length", "per-position acceptance (%)", "drafts", "speedup",
                         "greedy identical (run dtype)"],
                        [[_fmt(e["num_speculative_tokens"]), html.escape(e["sampling"]["name"]),
                          _fmt(e["overall"]["acceptance_length"]) + _interval(
                              (e["overall"].get("confidence") or {}).get("acceptance_length")),
                          _pct_list(e["overall"]["per_position_acceptance"]),
                          _fmt(e["overall"]["counts"]["drafts"]), _fmt(e["overall"]["speedup"]),
                          _count(e["overall"]["lossless"])] for e in report["runs"]]))
    if len(report.get("num_speculative_tokens") or []) < 2:
        parts.append("<p class='note'>One K was measured, so there are no plots against K "
                     "(set <code>evaluate.sweep_k</code> to measure more).</p>")

    for name, png in plots.items():
        data = base64.b64encode(png).decode()
        title = PLOT_TITLES.get(name, name)
        parts.append(f'<figure><img id="plot-{name}" alt="{html.escape(title)}" '
                     f'src="data:image/png;base64,{data}"><figcaption>{html.escape(title)}</figcaption></figure>')

    parts.append("<h2>Models and prompts</h2>")
    t, d = report.get("target") or {}, report.get("draft") or {}
    parts.append(_table(["", ""], [
        ["target", f"<code>{_fmt(t.get('path'))}</code>"], ["target fingerprint", f"<code>{_fmt(t.get('fingerprint'))}</code>"],
        ["draft", f"<code>{_fmt(d.get('path'))}</code>"], ["draft sha256", f"<code>{_fmt(d.get('sha256'))}</code>"],
        ["draft trained depths", _fmt(d.get("trained_depths"))]]))
    parts.append(_table(["category", "prompts", "source", "attribution"],
                        [[html.escape(c), _fmt(p["count"]), html.escape(p["source"]), html.escape(p["attribution"])]
                         for c, p in report["prompt_sets"].items()]))
    if str(report.get("device") or "").startswith("cpu"):
        parts.append("<p><b>Measured on CPU:</b> a small target is compute-bound there, so speculation can lower "
                     "batched tokens/s even when drafts are accepted; acceptance length and per-position "
                     "acceptance are the figures that carry over to GPUs.</p>")
    parts.append("<p>Acceptance length = 1 + accepted / drafts; per-position acceptance = accepted at position / "
                 "drafts (vLLM spec-decode counters, differenced around each workload). The offline estimate is "
                 "1 + &Sigma;<sub>k&lt;K</sub> &Pi;<sub>j&le;k</sub> p<sub>j</sub> from conditional top-1 agreement "
                 "on held-out hidden states.</p>")
    parts.append(f"<p>Created {html.escape(str(report.get('created_utc')))} · format "
                 f"<code>{html.escape(report['format'])}</code></p></body></html>")
    return "\n".join(parts)
