"""The bench scripts (bench/*.py) as modules, for tests that call their functions.

A bench imports its shared harness as ``harness`` (the script's own directory is on ``sys.path`` when it
runs); here the harness is loaded from its file under that name first, then the bench."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[2] / "bench"
SCRIPTS = sorted(p.stem for p in BENCH.glob("*.py") if p.stem != "harness")


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def load_bench(name: str) -> ModuleType:
    """``bench/<name>.py`` as a module (``harness`` for the harness itself); loaded once."""
    if "harness" not in sys.modules:
        _load("harness")
    return sys.modules.get(name) or _load(name)


def plan_run_dir(tmp_path: Path) -> Path:
    """A pipeline run directory as far as a bench's plan reads it: ``run.json`` with the embedded default's
    config and parameters."""
    import json

    from peagle.pipeline.local import embedded
    from peagle.run_config import RunConfig

    run = tmp_path / "run"
    run.mkdir()
    config = RunConfig.model_validate(embedded.merged_config({})).model_dump(mode="json")
    (run / "run.json").write_text(json.dumps({"config": config, "params": embedded.PARAMS, "run_uri": str(run)}))
    return run
