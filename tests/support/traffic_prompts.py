"""Prompt files and prompt sets for the traffic gate and ``peagle serve`` tests (unit and vLLM tiers)."""
from __future__ import annotations

import json
from pathlib import Path


def prompt_file(path: Path, n: int, stem: str = "traffic") -> Path:
    """A JSONL prompt file of ``n`` one-turn chats (ids ``<stem>-<i>``, alternating categories code/chat)."""
    rows = [{"id": f"{stem}-{i}", "messages": [{"role": "user", "content": f"Write a function number {i}."}],
             "category": "code" if i % 2 else "chat"} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def serve_prompts(tag: str, n: int):
    """``n`` one-turn prompts ``<tag><i>`` whose user content names the tag and the index."""
    from peagle.evaluate.prompts import Prompt

    return [Prompt(f"{tag}{i}", ({"role": "user", "content": f"{tag} question {i}: write a loop"},)) for i in range(n)]
