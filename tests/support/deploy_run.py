"""A run directory as the deploy init container fetches it: target/ as plain files, draft/ published."""
from __future__ import annotations

import os
from pathlib import Path

from peagle.storage import LocalStore, publish_dir


def make_run(src: Path) -> Path:
    """target/ as plain files, draft/ published with a manifest (as the trainer writes it)."""
    (src / "target").mkdir(parents=True)
    (src / "target" / "config.json").write_text('{"model_type": "qwen3"}')
    (src / "target" / "model.safetensors").write_bytes(os.urandom(4096))
    draft = src.parent / "draft-local"
    draft.mkdir()
    (draft / "config.json").write_text('{"speculators_model_type": "peagle"}')
    (draft / "model.safetensors").write_bytes(os.urandom(2048))
    publish_dir(LocalStore(src), "draft", draft)
    return src


def files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}
