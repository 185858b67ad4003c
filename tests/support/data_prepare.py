"""Shared pieces of the prepare-stage tests (tests/unit/data/test_data_prepare.py,
tests/integration/s3/test_data_prepare_s3.py): distinct ShareGPT rows, a JSONL writer, the stage's settings."""
from __future__ import annotations

import json
from pathlib import Path

from peagle.data import PrepareSettings

WORDS = "alpha beta gamma delta parse wrap token module return import class value".split()


def chat(i: int, turns: int = 1) -> dict:
    """A distinct ShareGPT row; ``turns`` human/gpt pairs."""
    conv = []
    for t in range(turns):
        conv.append({"from": "human", "value": f"Question {i}.{t}: what is {WORDS[i % len(WORDS)]}?"})
        conv.append({"from": "gpt", "value": f"Answer {i}.{t}: {WORDS[(i + t) % len(WORDS)]} {i * 7 + t}."})
    return {"id": f"c{i}", "conversations": conv}


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def settings_for(*sources: Path, **kw) -> PrepareSettings:
    kw.setdefault("validation_fraction", 0.2)
    kw.setdefault("max_length", 256)
    return PrepareSettings(sources=[str(s) for s in sources], **kw)
