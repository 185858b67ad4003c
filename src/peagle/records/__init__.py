"""The loop's records, in one low-level home: what a draft is (:mod:`.identity`) and the typed records the
traffic loop writes and reads back. Below every stage package (docs/structure.md, floor 3): it imports
pydantic and the floors below it only (errors, storage, stage_io, stats, net)."""
