"""Shared fixtures, and the test tiers (tests/README.md).

Every collected test gets exactly one tier marker, so ``-m unit`` (the fast tier), ``-m integration`` and
``-m e2e`` partition the suite:

* ``integration`` -- uses a real engine or server: the ``vllm`` marker (a real vLLM engine) or the
  ``weed_binary`` fixture (under ``seaweed_server``: a real SeaweedFS S3 server) make a test ``integration``;
  tests on kfp.local, the Helm SDK or real multi-process launches carry the marker explicitly;
* ``e2e`` -- a whole pipeline run (explicit marker);
* ``unit`` -- everything else (the default): in-process, tiny real models, seconds each.
"""
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from seaweed import seaweed_server, weed_binary  # noqa: F401 - the fixtures, for every test module
from tiny import build_target  # noqa: E402


@pytest.fixture(scope="session")
def qwen3_target(tmp_path_factory) -> Path:
    return build_target(tmp_path_factory.mktemp("targets") / "tiny-qwen3", "qwen3", seed=1)


@pytest.fixture(scope="session")
def llama_target(tmp_path_factory) -> Path:
    return build_target(tmp_path_factory.mktemp("targets") / "tiny-llama", "llama", seed=2)


def pytest_report_header(config):
    # Which kernels vLLM and torch pick depends on these: a failure on one kind of machine is
    # recognisable at a glance in CI's output.
    from peagle.cpu_features import describe

    return describe()


TIERS = ("unit", "integration", "e2e")
# Markers and fixtures that bring up a real engine or server: a test using one is never a unit test.
INTEGRATION_MARKERS = frozenset({"vllm"})
INTEGRATION_FIXTURES = frozenset({"weed_binary"})  # under seaweed_server and any other SeaweedFS server
TIERS_SEEN = pytest.StashKey[dict]()  # nodeid -> tiers, for every collected test (before -m deselects)


def tiers_of(markers: set[str], fixtures: set[str]) -> list[str]:
    """The tiers a test with these marker and fixture names belongs to (sorted; exactly one when consistent).

    Explicit tier markers are kept; ``integration`` is added when the test uses a real engine or server,
    unless it is already ``integration`` or ``e2e`` (an e2e run uses them all); ``unit`` when nothing else
    applies. A test explicitly marked ``unit`` that starts a server therefore gets two tiers: an error.
    """
    tiers = {t for t in TIERS if t in markers}
    real = bool(markers & INTEGRATION_MARKERS or fixtures & INTEGRATION_FIXTURES)
    if real and not tiers & {"integration", "e2e"}:
        tiers.add("integration")
    return sorted(tiers or {"unit"})


@pytest.hookimpl(tryfirst=True)  # before the mark plugin deselects by -m
def pytest_collection_modifyitems(config, items):
    seen = config.stash.setdefault(TIERS_SEEN, {})
    for item in items:
        markers = {m.name for m in item.iter_markers()}
        tiers = tiers_of(markers, set(item.fixturenames))
        for tier in set(tiers) - markers:
            item.add_marker(tier)
        seen[item.nodeid] = tiers


@pytest.fixture(autouse=True)
def _no_log_handler_outlives_its_test():
    """Commands set up logging with ``logging.basicConfig`` (a handler on the stream that is stderr at
    that moment, and the root level). Under pytest that stream is a test's capture, closed after it:
    a later record (any library's INFO line) then prints ``--- Logging error ---`` into another test's
    stderr. Put the root logger back as it was before each test, and drop any handler whose stream
    has been closed."""
    import logging

    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for h in list(root.handlers):
        if h not in handlers and not type(h).__module__.startswith("_pytest"):
            root.removeHandler(h)
    root.setLevel(level)
    for logger in [root, *(lg for lg in logging.root.manager.loggerDict.values() if isinstance(lg, logging.Logger))]:
        for h in list(logger.handlers):
            stream = getattr(h, "stream", None)
            if stream is not None and getattr(stream, "closed", False):
                logger.removeHandler(h)
