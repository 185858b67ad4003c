"""The test tiers: the directory a test lives in is its tier (tests/README.md).

``tests/unit/`` -> ``unit``, ``tests/integration/`` -> ``integration``, ``tests/e2e/`` -> ``e2e``; a test
module anywhere else is an error. What only a slower tier may use is refused in a faster one: a test
under ``tests/unit/`` with the ``vllm`` marker (a real vLLM engine), a SeaweedFS server (every one
starts from the ``weed_binary`` fixture) or an explicit tier marker of another tier fails collection (and a
``vllm`` test anywhere but ``tests/integration/vllm/`` or ``tests/e2e/``),
and one that reaches the Helm SDK fails when it does (conftest's guard).
"""
from __future__ import annotations

from pathlib import Path

TIERS = ("unit", "integration", "e2e")
# Only a real engine or server brings these; a unit test never does.
NOT_IN_UNIT_MARKERS = frozenset({"vllm"})
NOT_IN_UNIT_FIXTURES = frozenset({"weed_binary"})
SERIAL_GROUP = "engines"  # under pytest-xdist, every integration and e2e test runs in this one group


class TierError(Exception):
    """A test that its directory's tier cannot hold."""


def tier_of(path: Path, tests_root: Path, markers: set[str], fixtures: set[str]) -> str:
    """The tier of a test in the module at ``path``; :class:`TierError` names the test's problem."""
    try:
        top = Path(path).resolve().relative_to(tests_root.resolve()).parts[0]
    except (ValueError, IndexError):
        raise TierError(f"{path}: not under {tests_root}") from None
    if top not in TIERS:
        raise TierError(f"{path}: a test module must live under tests/unit, tests/integration or tests/e2e "
                        f"(the directory is its tier), not tests/{top}")
    others = {t for t in TIERS if t in markers} - {top}
    if others:
        raise TierError(f"{path}: marked {sorted(others)} but lives in tests/{top}: the directory is the tier; "
                        f"move the test instead of marking it")
    rel = Path(path).resolve().relative_to(tests_root.resolve()).parts
    if markers & NOT_IN_UNIT_MARKERS and top != "e2e" and rel[:2] != ("integration", "vllm"):
        raise TierError(f"{path}: starts a vLLM engine (the `vllm` marker) but lives in tests/{'/'.join(rel[:-1])}: "
                        f"vLLM tests live in tests/integration/vllm/, where they share engines")
    if top == "unit":
        real = sorted(markers & NOT_IN_UNIT_MARKERS) + sorted(fixtures & NOT_IN_UNIT_FIXTURES)
        if real:
            raise TierError(f"{path}: uses {real} (a real engine or server) but lives in tests/unit: move it "
                            f"to tests/integration/<vllm|s3|helm|processes>/")
    return top
