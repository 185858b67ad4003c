"""Traffic records for the traffic, refresh and rollout tests: one factory, one writer, and the secrets the
redaction tests plant (tests/unit/traffic/test_traffic_log.py and tests/integration/s3/test_traffic_log_s3.py)."""
from __future__ import annotations

from datetime import datetime

from peagle.traffic.log import TrafficWriter
from peagle.records.traffic import TrafficRecord
from peagle.traffic.settings import CaptureSettings

CHAT = "/v1/chat/completions"


def traffic_record(text: str = "hi", *, when: datetime | None = None, endpoint: str = CHAT,
                   **fields) -> TrafficRecord:
    """A captured request: ``text`` is the user's one message on the chat endpoint, the prompt on any other;
    ``fields`` are :meth:`TrafficRecord.new`'s other fields."""
    chat = endpoint.endswith("chat/completions")
    return TrafficRecord.new(received_at=when, endpoint=endpoint,
                             messages=[{"role": "user", "content": text}] if chat else None,
                             prompt=None if chat else text, **fields)


def spec_decode(histogram: list[int] | None, num_draft_tokens: int = 0, mean: float = 0.0) -> dict | None:
    """The ``spec_decode`` field of a record with this acceptance histogram (K = len - 1); None: none."""
    if histogram is None:
        return None
    return {"acceptance_histogram": list(histogram), "num_spec_tokens": len(histogram) - 1,
            "num_draft_tokens": num_draft_tokens, "mean_acceptance_length": mean}


def capture_settings(uri: str = "", **kw) -> CaptureSettings:
    """Capture on, a fast time-based flush, no retention."""
    return CaptureSettings(enabled=True, uri=uri, **{"flush_interval_s": 0.05, "retention_days": 0, **kw})


def write_records(store, records, **kw) -> TrafficWriter:
    """Write ``records`` through a :class:`TrafficWriter` (``kw``: capture settings) into ``store`` (a
    :class:`peagle.storage.Store`, or None: the settings' ``uri``), asserting each was accepted and all flushed."""
    settings = capture_settings(**kw)
    writer = TrafficWriter(settings, store) if store is not None else TrafficWriter(settings)
    for r in records:
        assert writer.submit(r)
    assert writer.close(30)
    return writer


# -- redaction before anything is written ----------------------------------------------------
SECRETS = {"email": "jane.doe@example.com", "card": "4111 1111 1111 1111", "aws": "AKIAIOSFODNN7EXAMPLE",
           "key": "sk-proj-abcdefghijklmnopqrstuvwxyz0123", "ip": "10.20.30.40"}


def secret_record() -> TrafficRecord:
    text = " ".join(SECRETS.values())
    return TrafficRecord.new(endpoint="/v1/completions", prompt=f"prompt {text}", response_text=f"reply {text}",
                             sampling={"user": SECRETS["email"]})


def assert_redacted(raw: bytes) -> None:
    assert raw, "nothing was written"
    for name, secret in SECRETS.items():
        assert secret.encode() not in raw, f"{name} reached the store"
    assert b"[REDACTED:email]" in raw and b"[REDACTED:card]" in raw and b"[REDACTED:aws_access_key]" in raw
