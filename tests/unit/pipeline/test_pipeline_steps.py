"""The pipeline's step functions (src/peagle/pipeline/steps.py) beyond what the component tests run: extract's
own retry of transient failures (KFP drops set_retry inside a ParallelFor)."""
from __future__ import annotations

import pytest


def test_extract_retries_transient_failures_and_not_bad_input():
    from peagle.pipeline.steps import retry_transient
    from peagle.storage.errors import ObjectNotFoundError, StorageConfigError, StorageTimeoutError

    waits: list[float] = []
    calls = []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise StorageTimeoutError("PUT s3://b/x timed out after 300s")
        return "done"

    policy = {"num_retries": 2, "backoff_duration": "60s", "backoff_factor": 2.0, "backoff_max_duration": "3600s"}
    lines: list[str] = []
    assert retry_transient(flaky, "extract[0]", policy, sleep=waits.append, out=lines.append) == "done"
    assert waits == [60.0, 120.0] and len(calls) == 3
    assert "attempt 1/3 failed" in lines[0] and "StorageTimeoutError" in lines[0]

    calls.clear()
    with pytest.raises(StorageTimeoutError):  # bounded: 1 + num_retries attempts
        retry_transient(lambda: calls.append(1) or (_ for _ in ()).throw(StorageTimeoutError("t")), "x",
                        {**policy, "num_retries": 1}, sleep=lambda s: None, out=lambda s: None)
    assert len(calls) == 2

    for permanent in (StorageConfigError("bad bucket"), ObjectNotFoundError("s3://b/run/data/_MANIFEST.json")):
        calls.clear()
        with pytest.raises(type(permanent)):  # bad input, a missing input: not retried
            retry_transient(lambda exc=permanent: calls.append(1) or (_ for _ in ()).throw(exc), "x", policy,
                            sleep=lambda s: None, out=lambda s: None)
        assert len(calls) == 1

    calls.clear()
    with pytest.raises(StorageTimeoutError):  # backoff_max_duration bounds the waiting too
        retry_transient(lambda: calls.append(1) or (_ for _ in ()).throw(StorageTimeoutError("t")), "x",
                        {**policy, "num_retries": 5, "backoff_max_duration": "100s"}, sleep=lambda s: None,
                        out=lambda s: None)
    assert len(calls) == 2  # waited 60s; the next 120s wait would pass 100s
