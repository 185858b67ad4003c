"""matplotlib figures of a report, as PNG bytes (Agg canvas; no pyplot global state, no display).

Every function takes the report dict of :mod:`peagle.evaluate.report` and returns PNG bytes, or
None when the report has nothing to draw for it (e.g. no baseline for the speedup plot).
"""
from __future__ import annotations

import io
from typing import Any

DPI = 100
SIZE = (7.5, 4.2)


def _figure():
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=SIZE, dpi=DPI)
    FigureCanvasAgg(fig)
    return fig


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png", dpi=DPI)
    return buf.getvalue()


def _headline_entry(report: dict[str, Any]) -> dict[str, Any]:
    s = report["summary"]
    return next(e for e in report["runs"] if e["num_speculative_tokens"] == s["num_speculative_tokens"]
                and e["sampling"]["name"] == s["sampling"]["name"])


def _lines(entry: dict[str, Any]) -> tuple[str, dict[str, dict[str, Any]]]:
    """The thin lines of a plot: one per prompt set when there are several, else one per category."""
    sets = entry.get("sets") or {}
    return ("set", sets) if len(sets) > 1 else ("category", entry["categories"])


def _error_bars(ax, xs: list[int], values: list[float | None], bounds: list | None, color: str, label: str | None,
                offset: float = 0.0) -> None:
    bars = [(x + offset, v, b) for x, v, b in zip(xs, values, bounds or []) if b and v is not None]
    if bars:  # bootstrap interval over prompts (peagle.stats.bootstrap)
        bx, bv, bb = zip(*bars)
        err = [[max(0.0, v - b[0]) for v, b in zip(bv, bb)], [max(0.0, b[1] - v) for v, b in zip(bv, bb)]]
        ax.errorbar(bx, bv, yerr=err, fmt="none", ecolor=color, capsize=4, label=label)


def per_position_acceptance_png(report: dict[str, Any]) -> bytes | None:
    """Acceptance per draft position (a_i = accepted_at_pos[i] / drafts), one line per prompt set
    (per category when there is one set), with bootstrap intervals for the sets and overall."""
    entry = _headline_entry(report)
    fig = _figure()
    ax = fig.add_subplot(1, 1, 1)
    drawn = False
    kind, lines = _lines(entry)
    for i, (name, f) in enumerate(lines.items()):
        y = f["per_position_acceptance"]
        if y:
            xs = list(range(1, len(y) + 1))
            ax.plot(xs, y, marker="o", linewidth=1.6 if kind == "set" else 1.2, alpha=0.85, color=f"C{i % 10}",
                    label=name)
            if kind == "set":
                _error_bars(ax, xs, y, (f.get("confidence") or {}).get("per_position_acceptance"), f"C{i % 10}",
                            None, offset=0.06 * (i + 1))
            drawn = True
    y = entry["overall"]["per_position_acceptance"]
    if y:
        ax.plot(range(1, len(y) + 1), y, marker="s", color="black", linewidth=2.5, label="overall")
        ci = entry["overall"].get("confidence") or {}
        _error_bars(ax, list(range(1, len(y) + 1)), y, ci.get("per_position_acceptance"), "black",
                    f"{int(ci.get('level', 0.95) * 100)}% interval (over prompts)")
        drawn = True
    if not drawn:
        return None
    k = entry["num_speculative_tokens"]
    ax.set_xticks(range(1, k + 1))
    ax.set_ylim(0, 1.02)
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance (accepted at position / drafts)")
    ax.set_title(f"Per-position acceptance, K={k}, {entry['sampling']['name']}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    return _png(fig)


def acceptance_length_vs_k_png(report: dict[str, Any]) -> bytes | None:
    """AL vs K: overall per sampling (thick, with bootstrap intervals), prompt sets (or categories)
    of the headline sampling (thin), offline estimate. None unless two or more K were measured (or
    the offline estimate gives a curve): one point is no curve."""
    curves = report["acceptance_length_vs_k"]
    head = report["summary"]["sampling"]["name"]
    if len(report.get("num_speculative_tokens") or []) < 2 and not report.get("offline"):
        return None
    fig = _figure()
    ax = fig.add_subplot(1, 1, 1)
    drawn = False

    def points(curve: dict[str, float | None]):
        pts = sorted((int(k), v) for k, v in curve.items() if v is not None)
        return [p[0] for p in pts], [p[1] for p in pts]

    head_runs = sorted((e for e in report["runs"] if e["sampling"]["name"] == head),
                       key=lambda e: e["num_speculative_tokens"])
    kind, lines = _lines(head_runs[0]) if head_runs else ("category", {})
    for i, name in enumerate(lines):
        figs = [(e["num_speculative_tokens"], (e["sets"] if kind == "set" else e["categories"])[name])
                for e in head_runs]
        pts = [(k, f["acceptance_length"], (f.get("confidence") or {}).get("acceptance_length"))
               for k, f in figs if f["acceptance_length"] is not None]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", linewidth=1.6 if kind == "set" else 1,
                    alpha=0.8, color=f"C{i % 10}", label=f"{name} ({head})")
            if kind == "set":
                _error_bars(ax, [p[0] for p in pts], [p[1] for p in pts], [p[2] for p in pts], f"C{i % 10}", None,
                            offset=0.05 * (i + 1))
            drawn = True
    for i, (name, cs) in enumerate(curves.items()):
        x, y = points(cs["overall"])
        if x:
            ax.plot(x, y, marker="s", linewidth=2.5, color="black" if name == head else f"C{7 + i % 3}",
                    linestyle="-" if name == head else "--", label=f"overall ({name})")
            if name == head:
                cis = {e["num_speculative_tokens"]: (e["overall"].get("confidence") or {}).get("acceptance_length")
                       for e in head_runs}
                _error_bars(ax, x, y, [cis.get(k) for k in x], "black", "95% interval (over prompts)")
            drawn = True
    offline = report.get("offline")
    if offline:
        x, y = points(offline["expected_acceptance_length"])
        ax.plot(x, y, linestyle=":", marker="^", color="grey", label="offline chain estimate")
        drawn = True
    if not drawn:
        return None
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xticks(sorted({int(k) for cs in curves.values() for k in cs["overall"]}))
    ax.set_xlabel("K (num_speculative_tokens)")
    ax.set_ylabel("acceptance length (1 + accepted / drafts)")
    ax.set_title("Acceptance length vs K")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    return _png(fig)


def speedup_vs_k_png(report: dict[str, Any]) -> bytes | None:
    """Throughput ratio (with draft / without) vs K, per sampling; None unless two or more K have one."""
    by_sampling: dict[str, list[tuple[int, float]]] = {}
    for e in report["runs"]:
        sp = e["overall"]["speedup"]
        if sp is not None:
            by_sampling.setdefault(e["sampling"]["name"], []).append((e["num_speculative_tokens"], sp))
    if not by_sampling or max(len(pts) for pts in by_sampling.values()) < 2:
        return None  # one K measured: a single point is no curve (the summary table has the figure)
    fig = _figure()
    ax = fig.add_subplot(1, 1, 1)
    for name, pts in by_sampling.items():
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", linewidth=2, label=name)
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xticks(sorted({p[0] for pts in by_sampling.values() for p in pts}))
    ax.set_xlabel("K (num_speculative_tokens)")
    ax.set_ylabel("speedup (tokens/s with draft / without)")
    ax.set_title("Throughput speedup vs K (same prompts, same run)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _png(fig)


def offline_agreement_png(report: dict[str, Any]) -> bytes | None:
    """Offline per-depth agreement (unconditional, conditional, prefix) on held-out hidden states."""
    off = report.get("offline")
    if not off:
        return None
    fig = _figure()
    ax = fig.add_subplot(1, 1, 1)
    for key, label, style in (("per_depth_agreement", "top-1 agreement at depth", "o-"),
                              ("conditional_agreement", "conditional (given earlier depths agree)", "^--"),
                              ("prefix_agreement", "prefix (all depths <= d agree)", "s-")):
        vals = off[key]
        xs = [i + 1 for i, v in enumerate(vals) if v is not None]
        ax.plot(xs, [v for v in vals if v is not None], style, label=label)
    ax.set_ylim(0, 1.02)
    ax.set_xticks(range(1, off["num_depths"] + 1))
    ax.set_xlabel("draft position (depth + 1)")
    ax.set_ylabel("fraction")
    ax.set_title(f"Offline agreement on {off['num_samples']} samples ({off['num_anchors']} anchors)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _png(fig)


def speedup_vs_concurrency_png(report: dict[str, Any]) -> bytes | None:
    """Throughput over the target alone's against requests in flight: one line per K, and the chosen
    schedule as served (bars: bootstrap intervals over requests); 1 = as fast as the target alone."""
    speed = report.get("speed")
    if not speed:
        return None
    table = speed["table"]
    fig = _figure()
    ax = fig.add_subplot(1, 1, 1)
    xs = table["concurrencies"]
    drawn = False
    for i, cfg in enumerate(c for c in table["configs"] if c != "target"):
        pts = {p["concurrency"]: p["speedup"] for p in table["points"] if p["config"] == cfg and p["speedup"]}
        if not pts:
            continue
        cx = [c for c in xs if c in pts]
        vals = [pts[c]["value"] for c in cx]
        schedule = cfg == "schedule"
        color = "black" if schedule else f"C{i}"
        ax.plot(cx, vals, marker="s" if schedule else "o", color=color, lw=2.5 if schedule else 1.5,
                label="chosen schedule (served)" if schedule else cfg)
        _error_bars(ax, cx, vals, [[pts[c]["low"], pts[c]["high"]] for c in cx], color, None)
        drawn = True
    if not drawn:
        return None
    ax.axhline(1.0, color="grey", ls="--", lw=1)
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [str(c) for c in xs])
    ax.set_xlabel("concurrent requests (batch size)")
    ax.set_ylabel("tokens/s over the target alone")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _png(fig)


PLOTS = {
    "per_position_acceptance": per_position_acceptance_png,
    "acceptance_length_vs_k": acceptance_length_vs_k_png,
    "speedup_vs_k": speedup_vs_k_png,
    "offline_agreement": offline_agreement_png,
    "speedup_vs_concurrency": speedup_vs_concurrency_png,
}


def render_plots(report: dict[str, Any]) -> dict[str, bytes]:
    """name -> PNG bytes for every plot that has data."""
    out = {}
    for name, fn in PLOTS.items():
        png = fn(report)
        if png is not None:
            out[name] = png
    return out
