"""The hidden-states hand-off as one typed contract (peagle.extract.hidden_states, issue 26): :class:`HiddenStates`
round-trips its records (plan, shard set, consumed marker, announcement), names a bad or garbage marker
(issue #29), and the streaming keys the run derives are refused as settings. That a marker beside a
published set changes nothing, for the reader and the trainer alike:
tests/unit/train/test_train_stream.py::test_a_stray_marker_beside_a_published_set_changes_nothing."""
from __future__ import annotations

import json

import pytest

from peagle.extract import ExtractError
from peagle.extract.hidden_states import (CONSUMED, MAX_MARKER_BYTES, PLAN, STREAM, ConsumedMarker, ExtractionPlan,
                                          HiddenStates, StreamAnnouncement, set_prefix, shard_key)
from peagle.extract.output import wait_for_turn
from peagle.extract.shard_format import DatasetHeader
from peagle.storage import is_complete, open_store, publish
from peagle.train import TrainRunConfig
from peagle.train.data import DatasetInfo

HEADER = DatasetHeader([1, 2, 3, 4], 8, 4, "fingerprint", "qwen3", "bfloat16", "bfloat16", "hf")


def _hs(tmp_path) -> HiddenStates:
    return HiddenStates(open_store(str(tmp_path / "hs")))


def _publish_one_set(hs: HiddenStates, shard_set: int = 0) -> dict:
    name = f"{set_prefix(shard_set)}-00000.safetensors"
    info = hs.put_shard(name, b"shard bytes")
    entry = {"name": name, "sha256": info.sha256, "bytes": info.size, "num_samples": 1, "num_tokens": 4,
             "num_supervised": 2, "sample_ids_sha256": "x"}
    hs.publish_set(shard_set, HEADER, [entry])
    return entry


def test_the_records_round_trip(tmp_path):
    hs = _hs(tmp_path)
    assert hs.plan() is None and hs.announcement() is None and hs.open_set(0) is None
    plan = ExtractionPlan("s3://bucket/run/data", "train", 4, 64)
    hs.publish_plan(plan)
    assert hs.plan() == plan
    assert plan.layout([f"s{i}" for i in range(5)]) == {  # row i goes to set i % 4
        "hs-00000-00000.safetensors": ["s0", "s4"], "hs-00001-00000.safetensors": ["s1"],
        "hs-00002-00000.safetensors": ["s2"], "hs-00003-00000.safetensors": ["s3"]}

    entry = _publish_one_set(hs)
    opened = hs.open_set(0)
    assert opened.header == HEADER and opened.entries == [entry]
    assert hs.published_set(0, HEADER)[0] == {entry["name"]: entry}
    assert hs.intact(entry) and hs.store.exists(shard_key(entry["name"]))
    assert DatasetInfo.of(HEADER) == DatasetInfo([1, 2, 3], 8, "fingerprint")
    assert HEADER.stored_bytes_per_token == 4 * 8 * 2

    hs.announce(StreamAnnouncement(min_sets_ahead=2))
    assert hs.announcement() == StreamAnnouncement(2, False)

    # deleting: the marker first, then the publication and the shards; the marker gives the header back
    assert not hs.is_consumed(0)
    hs.delete_set(0, ConsumedMarker(7, HEADER))
    assert not is_complete(hs.store, set_prefix(0)) and not hs.store.exists(shard_key(entry["name"]))
    assert hs.consumed(0) == ConsumedMarker(7, HEADER, "peagle.train") and hs.is_consumed(0)


@pytest.mark.parametrize("key, data, says", [
    (PLAN, b'{"prepared": "", "split": "train", "num_shard_sets": 4, "samples_per_shard": 2}',
     r"hs/_PLAN\.json: not an extraction plan"),
    (PLAN, b"[1]", r"hs/_PLAN\.json: not a extraction plan: a JSON list"),
    (STREAM, b'{"min_sets_ahead": -1}', r"hs/_STREAM\.json: not a streaming trainer's announcement"),
    (f"{set_prefix(3)}/{CONSUMED}", b'{"step": 1, "header": {"format": "peagle.hidden_states/v1"}}',
     r"hs-00003/_CONSUMED\.json: the consumed marker's header has no valid layer_ids: .*set 3 is still to be"),
])
def test_a_bad_marker_is_an_error_naming_it(tmp_path, key, data, says):
    hs = _hs(tmp_path)
    hs.store.put_bytes(key, data)
    read = {PLAN: hs.plan, STREAM: hs.announcement}.get(key, lambda: hs.consumed(3))
    with pytest.raises(ExtractError, match=says) as e:
        read()
    assert e.value.exit_code == 2


def test_a_set_with_a_bad_header_is_refused_naming_its_manifest(tmp_path):
    hs = _hs(tmp_path)
    _publish_one_set(hs)
    doc = json.loads(hs.store.get_bytes(f"{set_prefix(0)}/_MANIFEST.json"))
    assert doc["metadata"]["header"] == HEADER.as_dict()
    publish(hs.store, set_prefix(1), {"x": b"1"}, {"header": {**HEADER.as_dict(), "storage_dtype": "fp4"}})
    with pytest.raises(ExtractError, match=r"hs-00001/_MANIFEST\.json: its header has no valid storage_dtype"):
        hs.open_set(1)


@pytest.mark.parametrize("key", ["prepared", "split", "num_shard_sets", "samples_per_shard"])
def test_the_derived_stream_keys_are_no_settings(key):
    value = {"prepared": "data", "split": "train"}.get(key, 4)
    with pytest.raises(ValueError, match=rf"train\.stream\.{key}: not settings any more: .*_PLAN\.json"):
        TrainRunConfig.model_validate({"train": {"stream": {key: value}}})


# -- garbage in _CONSUMED.json and _STREAM.json is an error naming the file (issue #29) ----------------

GARBAGE = {"not json": b"{not json", "binary": bytes(range(256)), "a list": b"[1, 2]", "nested": b"[" * 100_000,
           "huge": b" " * (MAX_MARKER_BYTES + 1) + b"{}"}


@pytest.mark.parametrize("kind", [*GARBAGE, "wrong types"])
def test_garbage_stream_announcement_is_an_error_naming_it(tmp_path, kind):
    store = open_store(tmp_path / "hs")
    store.put_bytes(STREAM, GARBAGE.get(kind, b'{"min_sets_ahead": "2", "done": 0}'))
    with pytest.raises(ExtractError, match=r"hs/_STREAM\.json: .*not a streaming trainer's announcement") as e:
        wait_for_turn(HiddenStates(store), 1, 1, poll_s=0.01)
    assert e.value.exit_code == 2 and len(str(e.value)) < 400


@pytest.mark.parametrize("kind", [*GARBAGE, "wrong types"])
def test_garbage_consumed_marker_is_an_error_naming_it(tmp_path, kind):
    store = open_store(tmp_path / "hs")
    store.put_bytes(f"{set_prefix(1)}/{CONSUMED}", GARBAGE.get(kind, b'{"step": "7", "header": []}'))
    with pytest.raises(ExtractError, match=r"hs-00001/_CONSUMED\.json: .*not a consumed marker") as e:
        HiddenStates(store).is_consumed(1)
    assert e.value.exit_code == 2 and len(str(e.value)) < 400
