"""The test tiers (tests/support/tiers.py): the directory is the tier, so ``-m unit``, ``-m integration`` and
``-m e2e`` select exactly tests/unit, tests/integration and tests/e2e, and together the whole suite."""
import ast
from pathlib import Path

import pytest

from support.paths import TESTS
from support.tiers import TIERS, TierError, tier_of


def _collected(session) -> list:
    return list(session.items)


def test_every_selected_test_carries_exactly_its_directorys_tier(request):
    for item in _collected(request.session):
        top = Path(item.path).relative_to(TESTS).parts[0]
        assert [t for t in TIERS if item.get_closest_marker(t)] == [top], item.nodeid


@pytest.mark.parametrize("where, markers, fixtures, tier", [
    ("unit/train/test_x.py", set(), {"tmp_path"}, "unit"),
    ("integration/vllm/test_x.py", {"vllm"}, set(), "integration"),
    ("integration/vllm/test_x.py", set(), set(), "integration"),  # a check beside the engines needs no marker
    ("integration/s3/test_x.py", set(), {"seaweed_server", "weed_binary"}, "integration"),
    ("e2e/test_x.py", {"vllm"}, {"weed_binary"}, "e2e"),
    ("integration/helm/test_x.py", {"integration"}, set(), "integration"),  # a redundant marker is harmless
])
def test_the_directory_gives_the_tier(where, markers, fixtures, tier):
    assert tier_of(TESTS / where, TESTS, markers, fixtures) == tier


@pytest.mark.parametrize("where, markers, fixtures, says", [
    ("unit/test_x.py", {"vllm"}, set(), "vLLM tests live in tests/integration/vllm"),
    ("integration/processes/test_x.py", {"vllm"}, set(), "vLLM tests live in tests/integration/vllm"),
    ("unit/storage/test_x.py", set(), {"seaweed_server", "weed_binary"}, "a real engine or server"),
    ("unit/test_x.py", {"integration"}, set(), "the directory is the tier"),
    ("integration/helm/test_x.py", {"e2e"}, set(), "the directory is the tier"),
    ("test_x.py", set(), set(), "must live under tests/unit"),
    ("support/test_x.py", set(), set(), "must live under tests/unit"),
])
def test_a_test_its_directory_cannot_hold_is_refused(where, markers, fixtures, says):
    with pytest.raises(TierError, match=says):
        tier_of(TESTS / where, TESTS, markers, fixtures)


def test_a_unit_test_that_reaches_the_helm_sdk_fails():
    import helm_python

    with pytest.raises(AssertionError, match="tests/integration/helm"):
        helm_python.template  # noqa: B018 - the attribute access is what the guard refuses


def _imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    return names


def test_no_test_module_imports_another_or_conftest():
    # Shared helpers and factories live in tests/support; a test module is never a library.
    bad = {}
    for path in sorted(TESTS.rglob("*.py")):
        if path.parts[len(TESTS.parts)] == "support":
            continue
        wrong = {m for m in _imported_modules(path) if m.startswith("test_") or m == "conftest"}
        if wrong:
            bad[str(path.relative_to(TESTS))] = sorted(wrong)
    assert not bad


def test_test_modules_live_only_in_the_tier_directories_and_support_holds_no_tests():
    stray = [str(p.relative_to(TESTS)) for p in TESTS.rglob("test_*.py")
             if p.relative_to(TESTS).parts[0] not in TIERS]
    assert not stray
