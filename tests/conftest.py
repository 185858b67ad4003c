"""Shared fixtures, and the test tiers (tests/README.md, tests/support/tiers.py).

The directory is the tier: ``tests/unit/`` (in-process, tiny real models, seconds each),
``tests/integration/{vllm,helm,s3,processes}/`` (a real engine, tool, server or process tree) and
``tests/e2e/`` (a whole pipeline run). Every collected test gets its directory's marker, so ``-m unit``,
``-m integration`` and ``-m e2e`` select exactly those three directories.
"""
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from support.seaweed import s3_env, seaweed_server, weed_binary  # noqa: F401 - the fixtures, for every test module

# Fixtures defined in support modules, for every test: the session-scoped ladder of tiny artefacts, the
# stand-in Kubernetes API server of the TrainJob launcher tests.
pytest_plugins = ["support.ladder", "support.trainjob_apiserver"]
from support.tiers import SERIAL_GROUP, TierError, tier_of  # noqa: E402
from support.tiny import build_target  # noqa: E402


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


TIER = pytest.StashKey[str]()  # the tier given to each collected test (before -m deselects)
TESTS_ROOT = Path(__file__).parent


@pytest.hookimpl(tryfirst=True)  # before the mark plugin deselects by -m
def pytest_collection_modifyitems(config, items):
    errors = []
    for item in items:
        try:
            tier = tier_of(item.path, TESTS_ROOT, {m.name for m in item.iter_markers()}, set(item.fixturenames))
        except TierError as e:
            errors.append(f"{item.nodeid}: {e}")
            continue
        item.stash[TIER] = tier
        item.add_marker(tier)
    if errors:
        raise pytest.UsageError("tests in the wrong tier:\n" + "\n".join(errors))


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook: absent under -p no:xdist
def pytest_xdist_make_scheduler(config, log):
    """Under pytest-xdist (``-n``): the unit tier is spread over the workers module by module (a module's
    fixtures are built once, each worker has one torch thread), while every integration and e2e test is
    one unit of work: one worker runs them one after another, in file order, as a plain run would, so no
    two engines, servers or pipeline runs compete for the cores. The largest unit of work goes first (xdist
    orders them by size), so the engines start at once and the other workers take the unit tier."""
    from xdist.scheduler import LoadScopeScheduling

    class TierScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            tier = nodeid.split("/", 2)[1] if nodeid.startswith("tests/") else ""
            return SERIAL_GROUP if tier in ("integration", "e2e") else nodeid.split("::", 1)[0]

    return TierScheduling(config, log)


@pytest.fixture(autouse=True)
def _tier_guard(request, monkeypatch):
    """A unit test runs in-process on tiny models: reaching the Helm SDK fails it (the chart's renders are
    tests/integration/helm's), and under pytest-xdist it gets one torch thread (the workers share the cores)."""
    if request.node.stash.get(TIER, None) != "unit":
        yield
        return

    class _NoHelm:
        def __getattr__(self, name):
            if name.startswith("__"):  # module introspection (hypothesis reads every module's __file__)
                raise AttributeError(name)
            raise AssertionError("a unit test reached the Helm SDK (helm_python): move it to tests/integration/helm/")

    monkeypatch.setitem(sys.modules, "helm_python", _NoHelm())
    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        yield
        torch.set_num_threads(threads)
    else:
        yield


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
