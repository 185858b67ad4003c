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
