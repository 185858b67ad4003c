"""Find the pipeline definitions (``pipelines/``, ``components/`` at the project root) and compile them.

Two pipelines: ``peagle`` (``pipelines/peagle_pipeline.py``: train a draft from scratch and deploy it)
and ``refresh`` (``pipelines/peagle_refresh.py``: a candidate draft from captured traffic, gated
against the serving draft). Both are built for a cluster profile.

The pipeline and its components live next to ``src/`` (they are deployment assets, not library
code); this module puts the project root on ``sys.path`` to import them, the way
``peagle.deploy.render`` finds ``charts/``. ``$PEAGLE_PROJECT_DIR`` overrides the search.
"""
from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path
from typing import Any

from .profile import ClusterProfile, load_profile

COMPILED_DIR = Path("pipelines") / "compiled"
PROFILES_DIR = Path("pipelines") / "profiles"
PIPELINES = {"peagle": "pipelines.peagle_pipeline", "refresh": "pipelines.peagle_refresh"}  # name -> module


def project_dir() -> Path:
    """The directory holding ``pipelines/peagle_pipeline.py`` and ``components/``."""
    candidates = [os.environ.get("PEAGLE_PROJECT_DIR"), *Path(__file__).resolve().parents, Path.cwd()]
    for c in candidates:
        if c and (Path(c) / "pipelines" / "peagle_pipeline.py").is_file() and (Path(c) / "components").is_dir():
            return Path(c)
    raise FileNotFoundError("pipelines/peagle_pipeline.py not found: run from the project checkout "
                            "or set PEAGLE_PROJECT_DIR")


def profile_path(name_or_path: str | os.PathLike) -> Path:
    """A profile file: a path, or a name under ``pipelines/profiles`` (``default``, ``local``)."""
    p = Path(name_or_path)
    if p.suffix in (".yaml", ".yml") or p.exists():
        return p
    return project_dir() / PROFILES_DIR / f"{name_or_path}.yaml"


def pipeline_for(profile: ClusterProfile | str | os.PathLike = "default", pipeline: str = "peagle") -> Any:
    """The ``pipeline`` (a name in :data:`PIPELINES`) function built for ``profile`` (a ClusterProfile, a
    profile name or a file)."""
    if pipeline not in PIPELINES:
        raise ValueError(f"unknown pipeline {pipeline!r}; expected one of {sorted(PIPELINES)}")
    if not isinstance(profile, ClusterProfile):
        profile = load_profile(profile_path(profile))
    root = str(project_dir())
    if root not in sys.path:
        sys.path.insert(0, root)
    return importlib.import_module(PIPELINES[pipeline]).build_pipeline(profile)


def package_pipeline(package: str | os.PathLike) -> str:
    """Which of :data:`PIPELINES` a compiled package is (by its pipeline name); ``peagle`` for any other name."""
    import yaml

    with open(package, encoding="utf-8") as f:
        spec = next(yaml.safe_load_all(f), None) or {}
    name = (spec.get("pipelineInfo") or {}).get("name") if isinstance(spec, dict) else None
    return "refresh" if name == "peagle-refresh" else "peagle"


def compiled_path(profile_name: str, pipeline: str = "peagle") -> Path:
    """Where the committed YAML of a pipeline for a profile lives: ``pipelines/compiled/peagle-<profile>.yaml``,
    ``peagle-refresh.yaml`` (default profile) or ``peagle-refresh-<profile>.yaml``."""
    if pipeline == "refresh":
        name = "peagle-refresh" + ("" if profile_name == "default" else f"-{profile_name}")
    elif profile_name == "refresh" or profile_name.startswith("refresh-"):
        raise ValueError(f"profile name {profile_name!r} would compile to the refresh pipeline's file name; "
                         "rename the profile")
    else:
        name = f"peagle-{profile_name}"
    return project_dir() / COMPILED_DIR / f"{name}.yaml"


def init_run_component_path() -> Path:
    return project_dir() / "components" / "init_run.py"


def write_init_run_component() -> bool:
    """Regenerate ``components/init_run.py`` from the parameter definitions (``peagle pipeline compile``
    does, before compiling); True if it changed."""
    from .params import init_run_component_source

    path, text = init_run_component_path(), init_run_component_source()
    if path.read_text() == text:
        return False
    path.write_text(text)
    for name in ("components.init_run", "components"):  # already imported in this process: the new text
        if name in sys.modules:
            importlib.reload(sys.modules[name])
    return True


def compile_pipeline(profile: str | os.PathLike = "default", out: str | os.PathLike | None = None,
                     pipeline: str = "peagle") -> Path:
    """Compile ``pipeline`` for ``profile`` to IR YAML (what the OpenShift AI dashboard imports)."""
    from kfp import compiler

    path = profile_path(profile)
    prof = load_profile(path)
    out = Path(out) if out else compiled_path(prof.name, pipeline)
    out.parent.mkdir(parents=True, exist_ok=True)
    compiler.Compiler().compile(pipeline_for(prof, pipeline), package_path=str(out))
    return out
