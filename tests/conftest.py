import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

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
