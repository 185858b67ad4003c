"""The loop's records, in one low-level home: what a draft is (:mod:`.identity`) and the typed records the
traffic loop writes and reads back. Below every stage package: it imports only ``peagle.errors``,
``peagle.storage`` and pydantic."""
