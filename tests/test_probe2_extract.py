"""Issue #29, extraction: back-pressure that cannot end is refused or times out saying what it waits for,
the engine child dies with its parent, fan-out arguments are checked, consumed sets are skipped aloud.

Real pieces: the tiny Qwen3 target with the hf backend, a local store, real parent/child/grandchild
processes killed with SIGKILL.
"""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from peagle.cli import main
from peagle.config import ConfigError
from peagle.extract import ExtractError, ExtractSettings, make_header, run_extract
from peagle.extract.hidden_states import STREAM, ConsumedMarker, HiddenStates, StreamAnnouncement
from peagle.extract.output import wait_for_turn
from peagle.extract.shard_format import DatasetHeader
from peagle.run_config import RunConfig
from peagle.storage import open_store

REPO = Path(__file__).resolve().parents[1]
HF = dict(backend="hf", samples_per_shard=2, batch_size=4, hf_device="cpu")
STREAMING = {"train.data_mode": "streaming", "train.stream.delete_consumed": "true", "train.val_fraction": "0"}


def make_rows(n: int = 8) -> list[dict]:
    rng = random.Random(3)
    return [{"sample_id": f"conv-{i}", "input_ids": [rng.randrange(480) for _ in range(6)],
             "loss_mask": [0, 0, 1, 1, 1, 1]} for i in range(n)]


# ---------------------------------------------------------------------------------------------
# 1. max_sets_ahead: refused where no deleting trainer runs beside the workers; else a deadline


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


# ---------------------------------------------------------------------------------------------
# 1d. the engine child (and its workers) die with a parent killed by SIGKILL


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(") ")[-1][0] != "Z"  # a zombie is as good as gone
    except FileNotFoundError:
        return False


def _wait_gone(pids: list[int], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not any(_alive(p) for p in pids):
            return True
        time.sleep(0.05)
    return False


PARENT = textwrap.dedent("""
    import sys
    from peagle.engine.child import run_child
    CHILD = '''
    import os, subprocess, sys, time
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    with open(sys.argv[1] + ".tmp", "w") as fh:
        fh.write(f"{os.getpid()} {worker.pid}")
    os.rename(sys.argv[1] + ".tmp", sys.argv[1])
    time.sleep(300)
    '''
    run_child([sys.executable, "-c", CHILD, sys.argv[1]], timeout=300)
""")


def test_the_engine_child_and_its_workers_die_with_a_killed_parent(tmp_path):
    pid_file = tmp_path / "pids"
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(pid_file)],
                              env={**os.environ, "PYTHONPATH": str(REPO / "src")})
    pids: list[int] = []
    try:
        deadline = time.monotonic() + 60
        while not pid_file.exists():
            assert time.monotonic() < deadline and parent.poll() is None, "the child never started"
            time.sleep(0.05)
        pids = [int(p) for p in pid_file.read_text().split()]
        assert all(_alive(p) for p in pids)
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        assert _wait_gone(pids, 5), "the child or its worker outlived the parent killed with SIGKILL"
    finally:
        for pid in [parent.pid, *pids]:  # only the processes this test started
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_a_child_run_to_its_end_leaves_no_guard_behind():
    from peagle.engine.child import run_child

    def children() -> set[int]:
        out = set()
        for d in Path("/proc").iterdir():
            if d.name.isdigit():
                try:
                    if int((d / "stat").read_text().split(") ")[-1].split()[1]) == os.getpid():
                        out.add(int(d.name))
                except (FileNotFoundError, ProcessLookupError, IndexError):
                    pass
        return out

    before = children()
    assert run_child([sys.executable, "-c", "print('ok')"]).stdout == "ok\n"
    assert children() - before == set()


# ---------------------------------------------------------------------------------------------
# 2. fan-out arguments


def write_prepared(out: Path) -> Path:
    from prepared_data import write_prepared as write

    write(out, make_rows())
    return out


@pytest.mark.parametrize("index, count, named", [(5, 2, "--shard-index 5: must be in [0, 1] (--num-shards 2)"),
                                                 (-1, 2, "--shard-index -1: must be in [0, 1] (--num-shards 2)"),
                                                 (0, 0, "--num-shards 0: must be at least 1 (the number of "
                                                        "extraction workers)")])
def test_peagle_extract_refuses_a_shard_outside_the_fan_out(qwen3_target, tmp_path, capsys, index, count, named):
    data = write_prepared(tmp_path / "data")
    code = main(["extract", "--target", str(qwen3_target), "--backend", "hf", "--data", str(data), "--splits", "train",
                 "--out", str(tmp_path / "hs"), "--shard-index", str(index), "--num-shards", str(count)])
    assert code == 2
    assert capsys.readouterr().err == f"peagle: error: {named}\n"
    assert not (tmp_path / "hs").exists()


def test_peagle_extract_bad_shard_index_exits_2_as_a_command(qwen3_target, tmp_path):
    """The real command (it died with exit 134 before)."""
    data = write_prepared(tmp_path / "data")
    proc = subprocess.run([sys.executable, "-m", "peagle.cli", "extract", "--target", str(qwen3_target), "--backend",
                           "hf", "--data", str(data), "--splits", "train", "--out", str(tmp_path / "hs"),
                           "--shard-index", "5", "--num-shards", "2"], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO / "src")})
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == "peagle: error: --shard-index 5: must be in [0, 1] (--num-shards 2)"


def test_run_extract_refuses_a_shard_outside_the_fan_out(qwen3_target, tmp_path):
    with pytest.raises(ExtractError, match=r"^shard_index 5: must be in \[0, 1\] \(num_shards 2\)$"):
        run_extract(make_rows(), qwen3_target, tmp_path / "hs", ExtractSettings(**HF), shard_index=5, num_shards=2)
    with pytest.raises(ExtractError, match=r"^num_shards 0: must be at least 1"):
        run_extract(make_rows(), qwen3_target, tmp_path / "hs", ExtractSettings(**HF), shard_index=0, num_shards=0)
    assert not (tmp_path / "hs").exists()


# ---------------------------------------------------------------------------------------------
# 3. a consumed set is skipped aloud


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


@pytest.mark.vllm
def test_vllm_extraction_without_its_trainer_times_out_and_relays_what_it_waits_for(qwen3_target, tmp_path, capfd):
    """The wait runs in the engine child: its waiting line reaches this process's stderr, its timeout
    comes back as the ExtractError it raised there."""
    settings = ExtractSettings(backend="vllm", samples_per_shard=2, engine={"max_num_seqs": 4}, sets_per_worker=2,
                               max_sets_ahead=1, max_sets_ahead_timeout_s=2)
    with pytest.raises(ExtractError, match=r"hs-00001 waited .*\(extract\.max_sets_ahead_timeout_s=2\)"):
        run_extract(make_rows(), qwen3_target, tmp_path / "hs", settings)
    assert "[peagle.extract] shard set hs-00001 waits until a streaming trainer announces itself" in capfd.readouterr().err
    assert (tmp_path / "hs" / "hs-00000" / "_SUCCESS").exists()
