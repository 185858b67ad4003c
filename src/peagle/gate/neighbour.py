"""The gate's neighbouring set: prompts of the traffic's domain from another source (``gate.neighbour``).

A refresh fits the window of traffic it trained on; what users see next is the rest of that domain -- other
templates, other sources, next week's prompts. Besides the held-out traffic (the gain) and the general set
(the loss elsewhere), the gate measures a set *next door*: the same domain, not the same source. A candidate
that gains on its own window but loses next door beyond ``gate.neighbour_tolerance`` is rejected.

``gate.neighbour`` is a prompt set name (:func:`peagle.evaluate.prompts.load_prompt_sets`: ``code``,
``mtbench:coding``, a ``.jsonl`` file, ``<name>@<N>``; several joined with ``+``), ``""`` for none, or
``auto``: the domain of the held-out traffic is read from its prompts (:func:`detect_domain`) and its slice of
the project's own prompt sets and MT-Bench is measured (:data:`DOMAIN_SETS`); traffic of no known domain gets
no neighbouring set (the general set is its neighbour). The choice and why are recorded in ``gate.json``
(``sources.neighbour``) and printed.
"""
from __future__ import annotations

import re
from typing import Sequence

from ..evaluate.prompts import Prompt, PromptSet, load_prompt_sets

NEIGHBOUR = "neighbour"
AUTO = "auto"
# domain -> the prompt sets next door: the project's own category file and MT-Bench's category (other sources
# than any traffic a user captures; HumanEval, the scenario's traffic, is in neither)
DOMAIN_SETS = {"code": ("code", "mtbench:coding"), "math": ("math", "mtbench:math")}
DOMAIN_SHARE = 0.5  # a domain is the traffic's when at least this share of its prompts read as it

_CODE = re.compile(
    r"```|\bdef \w+\(|\bclass \w+[:(]|\bimport \w+|\breturn\b|\bfunction\b|[{};]\s*$|=>|\bSELECT\b.*\bFROM\b|"
    r"\b(python|javascript|typescript|java|c\+\+|rust|golang|sql|bash|regex|api|json|code|compile|debug|"
    r"implement|algorithm)\b", re.IGNORECASE | re.MULTILINE)
_MATH = re.compile(
    r"\b(solve|equation|integral|derivative|probability|prove|theorem|calculate|compute|sum of|how many|"
    r"percent|ratio|triangle|polynomial|matrix|prime)\b|\d\s*[-+*/^=]\s*\d|\$[^$]+\$", re.IGNORECASE)


def _text(p: Prompt) -> str:
    return "\n".join(str(m.get("content") or "") for m in p.messages if m.get("role") == "user")


def domain_of(text: str) -> str | None:
    """``code`` or ``math`` when the text reads as that domain (code first: code is full of numbers), else None."""
    if _CODE.search(text):
        return "code"
    if _MATH.search(text):
        return "math"
    return None


def detect_domain(prompts: Sequence[Prompt]) -> tuple[str | None, float]:
    """(the domain at least :data:`DOMAIN_SHARE` of ``prompts`` read as, or None; the largest share)."""
    if not prompts:
        return None, 0.0
    counts: dict[str, int] = {}
    for p in prompts:
        d = domain_of(_text(p))
        if d is not None:
            counts[d] = counts.get(d, 0) + 1
    if not counts:
        return None, 0.0
    domain, n = max(counts.items(), key=lambda kv: kv[1])
    share = n / len(prompts)
    return (domain if share >= DOMAIN_SHARE else None), share


def neighbour_prompt_set(spec: str, traffic: PromptSet) -> tuple[PromptSet | None, str]:
    """The neighbouring set ``gate.neighbour`` names for ``traffic`` (None: none), and a line saying which and
    why. Prompts whose text is also a traffic prompt's are left out (a neighbour is another source)."""
    spec = spec.strip()
    if not spec:
        return None, "no neighbouring set (gate.neighbour is empty)"
    if spec == AUTO:
        domain, share = detect_domain(traffic.prompts)
        if domain is None:
            return None, (f"no neighbouring set: the held-out traffic has no known domain (at most {share:.0%} of "
                          f"its prompts read as code or math, {DOMAIN_SHARE:.0%} needed; gate.neighbour=auto)")
        names = DOMAIN_SETS[domain]
        why = f"{share:.0%} of the held-out traffic reads as {domain}: {' + '.join(names)} (gate.neighbour=auto)"
    else:
        names = tuple(n.strip() for n in spec.split("+") if n.strip())
        why = f"{' + '.join(names)} (gate.neighbour)"
    seen = {_text(p).strip() for p in traffic.prompts}
    sets = load_prompt_sets(list(names)).values()
    prompts = [p for ps in sets for p in ps.prompts if _text(p).strip() not in seen]
    attribution = "; ".join(dict.fromkeys(ps.attribution for ps in sets))
    return (PromptSet(NEIGHBOUR, "+".join(names), attribution, prompts, group=NEIGHBOUR),
            f"neighbouring set: {len(prompts)} prompts of {why}")
