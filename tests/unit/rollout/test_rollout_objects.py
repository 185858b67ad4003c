"""Rollout objects (peagle.rollout.objects) refused before the chart renders: the candidate's values per
storage type, and an empty override. (The rendered phases: tests/integration/helm/test_rollout_objects_helm.py.)"""
from __future__ import annotations

import pytest

from peagle.deploy.render import RenderError
from peagle.rollout.objects import Candidate, candidate_values
from support.rollout_objects import CANDIDATE_FP, rollout


def test_candidate_values_per_storage_type():
    dc = {"storage": {"type": "dataConnection"}}
    assert candidate_values(dc, path="runs/b/") == {"storage": {"dataConnection": {"path": "runs/b/"}}}
    assert candidate_values({"storage": {"type": "pvc"}}, path="b") == {"storage": {"pvc": {"path": "b"}}}
    assert candidate_values({"storage": {"type": "uri"}}, path="s3://m/b/") == {"storage": {"uri": {"uri": "s3://m/b/"}}}
    assert candidate_values({"storage": {"type": "uris"}}, draft_uri="s3://m/d2") == {
        "storage": {"uris": {"draft": "s3://m/d2"}}}
    with pytest.raises(RenderError, match="draft URI"):
        candidate_values({"storage": {"type": "uris"}}, path="x")
    with pytest.raises(RenderError, match="prefix"):
        candidate_values(dc, draft_uri="s3://m/d2")
    with pytest.raises(RenderError, match="fingerprint"):
        Candidate(draft="d", fingerprint="XYZ", values={})


def test_kserve_raw_canary_refuses_an_empty_override():
    """Helm's mergeOverwrite would keep the stable's value: the canary would not serve what promotion serves."""
    c = Candidate(draft="d", fingerprint=CANDIDATE_FP, values={"storage": {"dataConnection": {"path": ""}}})
    with pytest.raises(RenderError, match="storage.dataConnection.path are empty"):
        rollout("kserve-canary-raw").stable(c, 10)
