"""Loop history records for tests: a whole, valid :class:`~peagle.records.refresh.RefreshEntry` (the history
refuses what its reader could not read back)."""
from __future__ import annotations

from peagle.records.refresh import RefreshEntry

FIRST, LAST = "2026-03-01T11:00:00.000000Z", "2026-03-01T11:59:00.000000Z"


def refresh_entry(i: int = 0, *, until: str = "2026-03-01T12:00:00.000000Z", verdict: str | None = "passed",
                  text: str = "") -> RefreshEntry:
    """Refresh number ``i`` (its ``rows["train"]``), its window ending at ``until``; ``text`` goes into its URI."""
    draft = {"uri": f"/drafts/{i}", "fingerprint": "d" * 12, "manifest_sha256": "e" * 64}
    return RefreshEntry(refresh_uri=f"/refreshes/{i}{text}", lineage=f"/refreshes/{i}/lineage.json",
                        created_at="2026-03-01T12:00:00Z",
                        window={"since": None, "until": until, "first_received_at": FIRST, "last_received_at": LAST},
                        counts={"usable": 16}, rows={"train": i}, target_fingerprint="f" * 64, base_draft=draft,
                        candidate={**draft, "uri": f"/refreshes/{i}/draft"}, verdict=verdict)


def lineage_doc(**overrides) -> dict:
    """A whole ``lineage.json`` document as a refresh writes it (``overrides`` replace top-level keys)."""
    covered = {"first_received_at": "2026-12-01T00:00:00.000000Z", "last_received_at": "2026-12-02T23:59:59.000000Z"}
    draft = {"uri": "s3://bucket/drafts/base", "fingerprint": "0123456789ab", "manifest_sha256": "f" * 64}
    doc = {
        "format": "peagle.traffic.lineage/v1", "peagle_version": "0.1.0", "created_at": "2026-12-03T00:00:00Z",
        "traffic": {"uri": "s3://bucket/traffic", "since": None, "until": None, "selected_at": None,
                    "covered": {**covered, "train": covered}},
        "counts": {"usable": 40, "train": 30, "heldout": 10}, "sampled_responses": "keep", "regenerated": None,
        "rows": {"traffic": {"train": 30}, "replayed": {"train": 10}, "total": {"train": 40}},
        "replay": {"fraction": 0.25, "base_data": "s3://bucket/base", "rows": {"train": 10}, "short": False},
        "target": {"path": "s3://bucket/target", "fingerprint": "f" * 64},
        "base_draft": draft, "candidate_draft": {**draft, "uri": "s3://bucket/refresh/draft", "fingerprint": "c" * 12},
        "gate": {"passed": True, "reasons": [], "report": "s3://bucket/refresh/gate/gate.json"},
        "settings": {"refresh": {}, "gate": {}},
        "outputs": {"draft": "s3://bucket/refresh/draft", "lineage": "s3://bucket/refresh/lineage.json"},
    }
    return {**doc, **overrides}
