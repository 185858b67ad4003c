"""What the refresh pipeline's components do: select -> prepare (+ replay) -> extract -> train -> gate.

Each function is the whole body of one KFP component (``components/refresh.py`` only calls it) and
calls the step of :mod:`peagle.refresh.steps` that ``peagle refresh`` runs, so the pipeline and
the command cannot differ. Stages hand each other the refresh URI
(``<output_root>/<run_name or job id>``) only; their data lives under it in the
layout of :class:`peagle.refresh.steps.RefreshLayout` (``selection/``, ``data/``,
``hidden_states/``, ``draft/``, ``gate/``, ``lineage.json``), plus ``run.json``: the resolved settings
(:class:`~peagle.pipeline.refresh_params.RefreshRun`) that :func:`select` writes first.

The target and the serving draft are fetched once per pod into the cache (a published prefix) or used
in place (a local directory); the steps get local paths.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..stage_io import join
from ..storage import check_uri, open_store
from .connection import check_data_connection
from .layout import run_uri as make_run_uri
from .objects import read_json, write_json
from .params import _validated, flatten
from .progress import stage
from .refresh_params import RefreshParams, RefreshRun, resolve_refresh
from .steps import fetch

RUN_JSON = "run.json"
# What each stage publishes, by the RefreshLayout attribute naming its prefix (lineage pointers).
STAGE_PREFIXES = {"select": "selection", "prepare": "data", "extract": "hidden_states", "train": "draft",
                  "gate": "gate"}


def layout_of(refresh_uri: str) -> Any:
    from ..refresh.steps import RefreshLayout

    return RefreshLayout.of(refresh_uri)


def load_refresh(refresh_uri: str) -> tuple[RefreshRun, Any]:
    """The refresh run's resolved settings (written by :func:`select`) and its layout."""
    return RefreshRun.model_validate(read_json(join(refresh_uri, RUN_JSON))), layout_of(refresh_uri)


def local(uri: str) -> str:
    """A local copy of a model: fetched into the cache once per pod (a published prefix), or the directory."""
    return str(fetch(uri))


def record(artifact: Any, refresh_uri: str, stage_name: str, summary: dict[str, Any] | None = None,
           **extra: Any) -> dict[str, Any]:
    """The lineage pointer (a KFP output artifact) of what ``stage_name`` published (see :mod:`.lineage`), with
    the scalars of the step's ``summary`` (nested keys joined with ``.``)."""
    from .lineage import record_prefix

    prefix = getattr(layout_of(refresh_uri), STAGE_PREFIXES[stage_name])
    scalars = {k: v for k, v in flatten(summary or {}).items() if isinstance(v, (bool, int, float, str))}
    return record_prefix(artifact, str(prefix), f"refresh.{stage_name}", **scalars, **extra)


def _dumps(summary: dict[str, Any]) -> str:
    return json.dumps(summary, sort_keys=True, default=str)


def select(*, output_root: str, run_name: str, job_id: str, config: str, data_connection: str = "",
           **params: Any) -> tuple[str, dict[str, Any]]:
    """Resolve and validate the settings, write ``<refresh>/run.json``, select the traffic window.

    Fails before any heavy work when a setting is invalid or the data connection lacks a key a URI needs.
    Returns the refresh URI every later step works on, and the selection's summary (counts, window).
    """
    from ..refresh.steps import select_step

    with stage("refresh.select") as info:
        p = _validated(RefreshParams, params)
        check_data_connection(data_connection, {"output_root": output_root, "target": p.target,
                                                "serving_draft": p.serving_draft, "traffic": p.traffic,
                                                "base_data": p.base_data})
        check_uri(output_root, "output_root")
        uri = make_run_uri(output_root, run_name, job_id)
        run = resolve_refresh(p, config, uri)
        write_json(join(uri, RUN_JSON), run.model_dump(mode="json"))
        summary = select_step(run.config, target=local(p.target), layout=layout_of(uri))
        info["counts"] = summary.get("counts")
        print(f"refresh {uri}: selected {_dumps(summary)}", flush=True)
    return uri, summary


def prepare(refresh_uri: str) -> dict[str, Any]:
    """Tokenise the selected traffic (served responses as the assistant turns) and mix in the replay rows
    of ``refresh.base_data``; returns the rows per split and origin."""
    from ..refresh.steps import prepare_step

    with stage("refresh.prepare") as info:
        run, layout = load_refresh(refresh_uri)
        summary = prepare_step(run.config, target=local(run.params.target), layout=layout)
        info["rows"] = summary.get("rows")
        print(f"prepared: {_dumps(summary)}", flush=True)
    return summary


def extract(refresh_uri: str) -> None:
    """The target's hidden states of the prepared rows."""
    from ..refresh.steps import extract_step

    with stage("refresh.extract"):
        run, layout = load_refresh(refresh_uri)
        extract_step(run.config, target=local(run.params.target), layout=layout)


def train(refresh_uri: str) -> str:
    """Train the candidate, warm-started from the serving draft; returns the candidate's URI."""
    from ..refresh.steps import train_step

    with stage("refresh.train") as info:
        run, layout = load_refresh(refresh_uri)
        info["candidate"] = candidate = train_step(run.config, target=local(run.params.target),
                                                   serving_draft=local(run.params.serving_draft), layout=layout)
        print(f"candidate draft: {candidate}", flush=True)
    return str(candidate)


def gate(refresh_uri: str, metrics: Any = None, html: Any = None) -> bool:
    """Gate the candidate against the serving draft (real vLLM, paired), log the verdict and its figures to
    ``metrics``, the page to ``html`` (KFP artifacts), write ``lineage.json``; returns the verdict.

    A rejected candidate is a verdict, not a failure: the step succeeds and returns False.
    """
    from ..traffic.gate import log_gate_metrics
    from ..traffic.gate_report import GATE_HTML
    from ..refresh.steps import gate_step, lineage_step

    with stage("refresh.gate") as info:
        run, layout = load_refresh(refresh_uri)
        target = local(run.params.target)
        result = gate_step(run.config, target=target, serving_draft=local(run.params.serving_draft), layout=layout)
        if metrics is not None:
            log_gate_metrics(result, metrics)
        if html is not None:  # the page as published (gate/gate.html), shown in the run's UI
            page = Path(getattr(html, "path", html))
            page.parent.mkdir(parents=True, exist_ok=True)
            page.write_bytes(open_store(str(layout.gate)).get_bytes(GATE_HTML))
        # the serving draft by its URI (lineage names where it lives); the target fingerprinted locally
        lineage_step(run.config, target=target, serving_draft=run.params.serving_draft, layout=layout, gate=result)
        info["passed"] = passed = bool(result.passed)
        print(f"gate {'passed' if passed else 'REJECTED'}: the candidate "
              f"{'beats' if passed else 'does not beat'} the serving draft", flush=True)
    return passed

