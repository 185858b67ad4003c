"""The extraction side of streaming (issue #29): back-pressure (extract.max_sets_ahead) is refused where no
deleting streaming trainer can relieve it, and otherwise waits with a deadline saying what it waits for;
a set a streaming trainer consumed is skipped aloud.

Real pieces: the tiny Qwen3 target with the hf backend, a local store. The same wait in the vLLM engine
child: tests/integration/vllm/test_extract_backpressure_vllm.py."""
from __future__ import annotations

import json
import threading
import time

import pytest

from peagle.cli import main
from peagle.config import ConfigError
from peagle.extract import ExtractError, ExtractSettings, make_header, run_extract
from peagle.extract.hidden_states import STREAM, ConsumedMarker, HiddenStates, StreamAnnouncement
from peagle.extract.output import wait_for_turn
from peagle.extract.shard_format import DatasetHeader
from peagle.run_config import RunConfig
from peagle.storage import open_store
from support.prepared_data import random_rows

HF = dict(backend="hf", samples_per_shard=2, batch_size=4, hf_device="cpu")
STREAMING = {"train.data_mode": "streaming", "train.stream.delete_consumed": "true", "train.val_fraction": "0"}


def make_rows() -> list[dict]:
    return random_rows(8, 6, seed=3, supervised_from=2)


# -- max_sets_ahead: refused where no deleting trainer runs beside the workers; else a deadline ----------


def test_max_sets_ahead_without_a_deleting_streaming_trainer_is_refused():
    with pytest.raises(ValueError, match=r"extract\.max_sets_ahead=1 needs train\.data_mode=streaming"):
        RunConfig.model_validate({"extract": {"max_sets_ahead": 1}})
    with pytest.raises(ValueError, match=r"extract\.max_sets_ahead=2 needs train\.stream\.delete_consumed=true"):
        RunConfig.model_validate({"extract": {"max_sets_ahead": 2}, "train": {"data_mode": "streaming"}})
    ok = RunConfig.model_validate({"extract": {"max_sets_ahead": 2}, "train": {
        "data_mode": "streaming", "val_fraction": 0, "stream": {"delete_consumed": True}}})
    assert ok.extract.max_sets_ahead == 2 and ok.extract.max_sets_ahead_timeout_s == 86400


def test_peagle_extract_refuses_max_sets_ahead_without_a_trainer(qwen3_target, tmp_path, capsys):
    code = main(["extract", "--target", str(qwen3_target), "--backend", "hf", "--max-sets-ahead", "1",
                 "--set", f"work_dir={tmp_path}"])
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith("peagle: error: ")
    assert ("extract.max_sets_ahead=1 needs train.data_mode=streaming (the workers wait for a trainer deleting "
            "consumed sets): set it or unset extract.max_sets_ahead") in err
    assert not (tmp_path / "hidden_states").exists()


def test_peagle_run_refuses_back_pressure_its_trainer_cannot_relieve(tmp_path):
    """peagle run (kfp.local) runs one task at a time and trains after every extract worker: a worker
    waiting for the trainer's consumption would wait for ever. Refused before the pipeline starts."""
    from peagle.pipeline.local.job import pipeline_arguments, user_settings

    overrides = [f"{k}={v}" for k, v in {**STREAMING, "extract.max_sets_ahead": 1}.items()]
    user = user_settings(None, overrides + [f"work_dir={tmp_path}"])
    with pytest.raises(ConfigError, match=r"extract\.max_sets_ahead=1 .*peagle run .*after every worker"):
        pipeline_arguments(user)
    same_without = user_settings(None, [f"{k}={v}" for k, v in STREAMING.items()])
    assert "config" in pipeline_arguments(same_without)  # streaming with deletion alone is fine


def test_back_pressure_wait_has_a_deadline_and_says_what_it_waits_for(tmp_path):
    store = open_store(str(tmp_path / "hs"))
    hs = HiddenStates(store)
    told: list[str] = []
    t0 = time.monotonic()
    with pytest.raises(ExtractError) as info:
        wait_for_turn(hs, 3, 1, poll_s=0.05, timeout_s=0.6, report_every_s=0.25, tell=told.append)
    assert time.monotonic() - t0 < 5
    message = str(info.value)
    assert message.startswith(f"shard set {store.uri_for('hs-00003')} waited ")
    assert "extract.max_sets_ahead_timeout_s=0.6" in message and store.uri_for(STREAM) in message
    assert 2 <= len(told) <= 4  # at the start, then every report_every_s
    assert all(t.startswith("shard set hs-00003 waits until a streaming trainer announces itself") for t in told)

    # announced: it waits for the set `lag` behind, and names it and the lag
    hs.announce(StreamAnnouncement(min_sets_ahead=2))
    told.clear()
    with pytest.raises(ExtractError, match=r"hs-00003 waited .* until the trainer has consumed set 1 \(lag 2\)"):
        wait_for_turn(hs, 3, 1, poll_s=0.05, timeout_s=0.3, report_every_s=10, tell=told.append)
    assert len(told) == 1 and told[0].startswith("shard set hs-00003 waits until the trainer has consumed set 1 (lag 2)")

    # the trainer consumes set 1 while the set waits: it goes on
    header = DatasetHeader([1, 2, 3, 4], 8, 4, "fingerprint", "qwen3", "bfloat16", "bfloat16", "hf")
    threading.Timer(0.3, hs.mark_consumed, (1, ConsumedMarker(1, header))).start()
    waited = wait_for_turn(hs, 3, 1, poll_s=0.05, timeout_s=30, tell=told.append)
    assert 0.2 < waited < 10


def test_extraction_without_its_trainer_fails_after_the_timeout_naming_the_set(qwen3_target, tmp_path, capsys):
    settings = ExtractSettings(**HF, sets_per_worker=2, max_sets_ahead=1, max_sets_ahead_timeout_s=1.5)
    t0 = time.monotonic()
    with pytest.raises(ExtractError, match=r"hs-00001 waited .*\(extract\.max_sets_ahead_timeout_s=1\.5\)"):
        run_extract(make_rows(), qwen3_target, tmp_path / "hs", settings)
    assert time.monotonic() - t0 < 60
    err = capsys.readouterr().err
    assert "[peagle.extract] shard set hs-00001 waits until a streaming trainer announces itself" in err
    assert (tmp_path / "hs" / "hs-00000" / "_SUCCESS").exists()  # set 0 went at once


# -- a consumed set is skipped aloud ------------------------------------------------------------------


def test_a_consumed_set_is_skipped_saying_so(qwen3_target, tmp_path, capsys):
    out = tmp_path / "hs"
    store = open_store(str(out))
    settings = ExtractSettings(**HF, sets_per_worker=2)
    header = make_header(qwen3_target, settings)[0]
    HiddenStates(store).mark_consumed(0, ConsumedMarker(4, header))
    res = run_extract(make_rows(), qwen3_target, out, settings)
    assert res.shards_consumed == ["hs-00000-00000.safetensors", "hs-00000-00001.safetensors"]
    assert res.shards_written == ["hs-00001-00000.safetensors", "hs-00001-00001.safetensors"]
    err = capsys.readouterr().err
    assert f"[peagle.extract] shard set {store.uri_for('hs-00000')} skipped: a streaming trainer consumed it" in err
    assert "hs-00001" not in err
    assert json.loads((out / "hs-00000" / "_CONSUMED.json").read_text())["step"] == 4
