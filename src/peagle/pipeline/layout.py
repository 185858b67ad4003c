"""Where one pipeline run keeps its data: one object-store prefix per run, fixed sub-prefixes per stage.

Components hand each other only the run's URI (a short string); every stage finds its inputs and
writes its outputs at the paths below, so heavy data never passes through Kubeflow itself::

    <run>/run.json                       resolved configuration of the run (written by init_run)
    <run>/models/target/                 the normalised target      } one prefix with target/ and draft/:
    <run>/models/draft/                  the trained, servable draft } what KServe downloads (deploy)
    <run>/regenerated/                   conversations rewritten by the target (optional stage)
    <run>/data/                          prepared, tokenised rows (peagle prepare)
    <run>/hidden_states/{train,validation}/   extraction output (peagle extract, sharded)
    <run>/train/                         checkpoints and final/ (peagle train)
    <run>/evaluate/                      report.json, report.html
    <run>/deploy/                        rendered serving manifests

A run URI is ``s3://bucket/prefix`` (``s3:///prefix``: the bucket comes from ``AWS_S3_BUCKET``, the
OpenShift AI data-connection key) or a local path. ``file://`` URIs are turned into plain paths,
because the stage I/O helpers treat anything with ``://`` other than a path as remote.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from ..stage_io import is_remote, join, local_path
from ..storage import parse_uri

SPLITS = ("train", "validation")
_RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def normalize_uri(uri: str) -> str:
    """``file:///abs/path`` -> ``/abs/path``; other URIs and paths unchanged (trailing ``/`` removed)."""
    uri = str(uri).strip()
    if uri.startswith("file://"):
        return str(local_path(uri)).rstrip("/") or "/"
    return uri.rstrip("/") if uri not in ("/",) else uri


def run_uri(output_root: str, run_name: str, job_id: str) -> str:
    """The run's prefix: ``<output_root>/<run_name or job_id>``.

    An explicit ``run_name`` makes a rerun land on the same prefix, so finished stages are reused
    (published extraction shards are skipped, training resumes from its last checkpoint).
    """
    name = (run_name or job_id or "").strip()
    if not _RUN_NAME.match(name):
        raise ValueError(f"run name {name!r} must be 1-128 characters of letters, digits, '.', '_' or '-'")
    root = normalize_uri(output_root)
    if not root:
        raise ValueError("output_root is empty: give an s3:// prefix (data connection bucket) or a local directory")
    return join(root, name)


@dataclass(frozen=True)
class RunLayout:
    """The fixed sub-prefixes of one run (see the module docstring)."""

    root: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", normalize_uri(self.root))

    @property
    def remote(self) -> bool:
        return is_remote(self.root)

    @property
    def run_json(self) -> str:
        return join(self.root, "run.json")

    @property
    def models(self) -> str:
        return join(self.root, "models")

    @property
    def target(self) -> str:
        return join(self.root, "models", "target")

    @property
    def draft(self) -> str:
        return join(self.root, "models", "draft")

    @property
    def regenerated(self) -> str:
        return join(self.root, "regenerated")

    @property
    def data(self) -> str:
        return join(self.root, "data")

    def hidden_states(self, split: str) -> str:
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
        return join(self.root, "hidden_states", split)

    @property
    def train(self) -> str:
        return join(self.root, "train")

    @property
    def evaluate(self) -> str:
        return join(self.root, "evaluate")

    @property
    def deploy(self) -> str:
        return join(self.root, "deploy")


def bucket_and_key(uri: str) -> tuple[str, str]:
    """``s3://bucket/a/b`` -> (``bucket``, ``a/b``); the bucket is empty for ``s3:///a/b``."""
    parsed = parse_uri(uri)  # the storage URI rule (peagle.storage.uri), not a second parser
    if parsed.scheme != "s3":
        raise ValueError(f"{uri!r} is not an s3:// URI")
    return parsed.bucket, parsed.prefix
