"""Streaming mode, in-process: the trainer reads shard sets as the extraction publishes them, in the
extraction plan's layout (the same samples under the same indices as the stored dataset); its settings and
the errors that name a missing plan or set. The runs with extraction workers in their own processes are in
tests/integration/processes/test_train_stream_processes.py, the kill -9 run on SeaweedFS in
tests/integration/s3/test_train_stream_s3.py.
"""
from __future__ import annotations

import pytest

from peagle.extract import ExtractSettings, run_extract
from peagle.extract.hidden_states import ExtractionPlan, HiddenStates, plan_layout
from peagle.train import TrainRunConfig
from peagle.train.data import DatasetError, ExtractedDataset
from peagle.train.stream import StreamedExtraction
from support.train_stream import HF, NUM_SETS, PER_SHARD, WORKERS, rows, stream_config, write_prepared


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> str:
    return write_prepared(str(tmp_path_factory.mktemp("prepared") / "data"))


def test_the_trainer_plans_the_extraction_layout_from_the_prepared_rows(qwen3_target, prepared, tmp_path):
    out = str(tmp_path / "hs")
    for w in range(WORKERS):
        run_extract(rows(), qwen3_target, out, ExtractSettings(**HF), shard_index=w, num_shards=WORKERS,
                    prepared=prepared)
    assert HiddenStates.at(out).plan() == ExtractionPlan(prepared, "train", NUM_SETS, PER_SHARD)
    stored = ExtractedDataset(out)
    streamed = StreamedExtraction(out, stream_config(qwen3_target, tmp_path, out, prepared).train.stream)
    # the same samples under the same indices as the stored dataset's manifest order
    assert [streamed.sample_id(i) for i in range(len(streamed))] == [stored.sample_id(i) for i in range(len(stored))]
    assert [streamed.shard_of(i) for i in range(len(streamed))] == [stored.shard_of(i) for i in range(len(stored))]
    assert streamed.info == stored.info
    assert streamed[5]["aux_hidden"].equal(stored[5]["aux_hidden"])
    assert list(plan_layout([r["sample_id"] for r in rows()], NUM_SETS, PER_SHARD))[:2] == [
        "hs-00000-00000.safetensors", "hs-00000-00001.safetensors"]
    # a plan that is not the layout the sets were written with is caught at the first set, naming it
    HiddenStates.at(out).publish_plan(ExtractionPlan(prepared, "train", NUM_SETS + 1, PER_SHARD))
    with pytest.raises(DatasetError, match=r"hs-00000 holds other shards or samples than planned in .*_PLAN\.json "
                       r"\(split 'train' of .* in 5 shard sets of shards of 4 samples\)"):
        StreamedExtraction(out, stream_config(qwen3_target, tmp_path, out, prepared).train.stream)


def test_streaming_settings_are_checked(qwen3_target, prepared, tmp_path):
    with pytest.raises(ValueError, match="train.val_fraction=0"):
        TrainRunConfig.model_validate({"train": {"data_mode": "streaming", "stream": {"delete_consumed": True},
                                                 "val_fraction": 0.1}})
    with pytest.raises(ValueError, match="window_byte"):
        TrainRunConfig.model_validate({"train": {"stream": {"window_byte": 1}}})  # unknown keys are errors
    with pytest.raises(ValueError, match=r"train.stream.prepared, train.stream.num_shard_sets: not settings any more"):
        TrainRunConfig.model_validate({"train": {"stream": {"prepared": prepared, "num_shard_sets": 4}}})
    cfg = stream_config(qwen3_target, tmp_path, str(tmp_path / "never"), prepared, wait_timeout_s=0.5)
    with pytest.raises(DatasetError, match=r"the extraction plan .*never/_PLAN\.json is not published after 0 s "
                       ".*extraction worker fail"):
        StreamedExtraction(cfg.train.data, cfg.train.stream)
    HiddenStates.at(cfg.train.data).publish_plan(ExtractionPlan(prepared, "train", NUM_SETS, PER_SHARD))
    with pytest.raises(DatasetError, match=r"hs-00000 is not published after 0 s .*extraction worker fail"):
        StreamedExtraction(cfg.train.data, cfg.train.stream)


def test_a_streaming_trainer_names_a_missing_shard_at_once(qwen3_target, tmp_path):
    """Before: a published shard set missing a shard was 'not published' to the trainer, which waited
    train.stream.wait_timeout_s (a day by default) and then blamed the extraction worker."""
    import time

    prepared = write_prepared(str(tmp_path / "data"))
    out = str(tmp_path / "hs")
    one_set = ExtractSettings(**{**HF, "sets_per_worker": 1})  # the same layout, set 0 alone
    run_extract(rows(), qwen3_target, out, one_set, shard_index=0, num_shards=NUM_SETS, prepared=prepared)
    (tmp_path / "hs" / "hs-00000" / "hs-00000-00001.safetensors").unlink()
    cfg = stream_config(qwen3_target, tmp_path, out, prepared, wait_timeout_s=30)
    start = time.monotonic()
    with pytest.raises(DatasetError, match=r"hs-00000/hs-00000-00001\.safetensors is named in the manifest but"):
        StreamedExtraction(out, cfg.train.stream)
    assert time.monotonic() - start < 10


# -- issue #29 (folded from test_probe2_stream by h1): under train.max_steps only sets no planned step reads
# any more are deleted; a bad marker of a deleted set 0 stops the trainer with exit 2; a stray marker beside
# a published set changes nothing. Real pieces: a finished two-worker extraction, copied per test.

import json  # noqa: E402
import re  # noqa: E402
import shutil  # noqa: E402

from peagle.extract.hidden_states import CONSUMED, PLAN, set_prefix  # noqa: E402
from peagle.extract.shard_format import DatasetHeader  # noqa: E402
from peagle.storage import is_complete, open_store  # noqa: E402
from peagle.train import train  # noqa: E402
from peagle.train.__main__ import main as train_main  # noqa: E402
from support.train_stream import ROWS, TOKENS, hidden_state_bytes  # noqa: E402


@pytest.fixture(scope="module")
def extracted(qwen3_target, prepared, tmp_path_factory) -> str:
    """A finished extraction (every set published); tests work on copies."""
    out = str(tmp_path_factory.mktemp("extracted") / "hs")
    for w in range(WORKERS):
        run_extract(rows(), qwen3_target, out, ExtractSettings(**HF), shard_index=w, num_shards=WORKERS,
                    prepared=prepared)
    return out


def _copy(extracted: str, tmp_path) -> str:
    out = str(tmp_path / "hs")
    shutil.copytree(extracted, out)
    return out


def _one_set_bytes(out: str) -> int:
    """Estimated stored bytes of one shard set (every set holds ROWS / NUM_SETS rows of TOKENS tokens)."""
    header = json.loads(open_store(out).get_bytes(f"{set_prefix(0)}/_MANIFEST.json"))["metadata"]["header"]
    return DatasetHeader.from_dict(header).stored_bytes_per_token * TOKENS * ROWS // NUM_SETS


def test_max_steps_below_the_plan_deletes_only_sets_read_for_good(qwen3_target, prepared, extracted, tmp_path):
    out = _copy(extracted, tmp_path)
    store = open_store(out)
    one_set = _one_set_bytes(out)

    def config(max_steps):
        cfg = stream_config(qwen3_target, tmp_path / "run", out, prepared, window_bytes=one_set,
                            delete_consumed=True, val_fraction=0.0)
        cfg.train.max_steps = max_steps
        return cfg

    # One set per window, 8 samples of 16 tokens per set, rows of 40 tokens (2 samples), 2 rows a step:
    # steps 2s and 2s + 1 read set s. Stopping after 5 steps, set 2 is half read: it must stay.
    first = train(config(5))
    assert first.steps == 5
    assert [store.exists(f"{set_prefix(s)}/{CONSUMED}") for s in range(NUM_SETS)] == [True, True, False, False]
    assert [HiddenStates(store).is_consumed(s) for s in range(NUM_SETS)] == [True, True, False, False]
    assert is_complete(store, set_prefix(2)) and is_complete(store, set_prefix(3))

    # A rerun worker skips only what was consumed and reuses the half-read set 2.
    again = run_extract(rows(), qwen3_target, out, ExtractSettings(**HF), shard_index=0, num_shards=WORKERS,
                        prepared=prepared)
    assert again.shards_written == []
    assert {n.split("-")[1] for n in again.shards_consumed} == {"00000"}
    assert {n.split("-")[1] for n in again.shards_skipped} == {"00002"}

    # A longer rerun continues from the checkpoint and finds every set it still needs.
    second = train(config(None))
    assert (second.resumed_from, second.steps) == (5, 8)
    assert all(HiddenStates(store).is_consumed(s) for s in range(NUM_SETS)) and hidden_state_bytes(store) == 0


@pytest.mark.parametrize("marker, says", [
    (b"\xff\xfe garbage", r"hs-00000/_CONSUMED\.json: .*not a consumed marker"),
    (json.dumps({"step": 3, "by": "peagle.train", "header": {"format": "other"}}).encode(),
     r"hs-00000/_CONSUMED\.json: the consumed marker's header has no valid format"),
])
def test_the_trainer_stops_with_exit_2_on_a_bad_marker_of_a_deleted_set_0(qwen3_target, prepared, extracted,
                                                                         tmp_path, capsys, marker, says):
    out = str(tmp_path / "hs")
    open_store(out).put_bytes(PLAN, open_store(extracted).get_bytes(PLAN))  # the workers' plan, no set published yet
    open_store(out).put_bytes(f"{set_prefix(0)}/{CONSUMED}", marker)  # set 0 is not published
    cfg = stream_config(qwen3_target, tmp_path / "run", out, prepared, delete_consumed=True, val_fraction=0.0,
                        wait_timeout_s=5)
    config = tmp_path / "train.yaml"
    config.write_text(json.dumps(cfg.model_dump(mode="json")))  # JSON is YAML
    assert train_main(["--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("peagle: error: ") and "Traceback" not in err
    assert re.search(says, err), err


def test_a_stray_marker_beside_a_published_set_changes_nothing(qwen3_target, prepared, extracted, tmp_path):
    out = _copy(extracted, tmp_path)
    store = open_store(out)
    store.put_bytes(f"{set_prefix(0)}/{CONSUMED}", b"\x00 garbage")
    store.put_bytes(f"{set_prefix(2)}/{CONSUMED}", json.dumps(
        {"step": 3, "by": "peagle.train", "header": {"format": "other"}}).encode())
    assert [HiddenStates(store).is_consumed(s) for s in range(NUM_SETS)] == [False] * NUM_SETS
    assert HiddenStates(store).consumed(0) is None and HiddenStates(store).consumed(2) is None

    # The trainer takes set 0's verified header, not the marker's, and reads set 0.
    cfg = stream_config(qwen3_target, tmp_path / "run", out, prepared, val_fraction=0.0, wait_timeout_s=5)
    ds = StreamedExtraction(out, cfg.train.stream)
    set0 = json.loads(store.get_bytes(f"{set_prefix(0)}/_MANIFEST.json"))["metadata"]["header"]
    assert ds.header == DatasetHeader.from_dict(set0) and ds.deleted_sets == []
    assert ds[0]["aux_hidden"].shape[0] == TOKENS

    # A rerun worker reuses its published sets 0 and 2: it skips none as consumed.
    again = run_extract(rows(), qwen3_target, out, ExtractSettings(**HF), shard_index=0, num_shards=WORKERS)
    assert again.shards_consumed == [] and again.shards_written == []
    assert {n.split("-")[1] for n in again.shards_skipped} == {"00000", "00002"}
