"""Progress of a real vLLM regeneration: the child's per-request progress reaches the parent reporter,
the plain line is printed and the local runner's display turns the events into lines."""
from __future__ import annotations

import io
import json

import pytest

from peagle import progress as pm
from peagle.data.regenerate import run_regenerate
from peagle.data.settings import RegenerateSettings
from peagle.pipeline.local.runner import _Display


@pytest.fixture
def events(tmp_path, monkeypatch):
    path = tmp_path / "progress.jsonl"
    monkeypatch.setenv(pm.ENV, str(path))
    monkeypatch.delenv(pm.STAGE_ENV, raising=False)

    def read() -> list[dict]:
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    read.path = path
    return read


@pytest.mark.vllm
def test_real_vllm_regeneration_reports_progress_to_the_end(tmp_path, events, qwen3_target, capsys, monkeypatch):
    """The child's per-request progress reaches the parent: events end with done == total, the
    plain line (what a KFP pod log shows) is printed, and the display turns the events into lines."""
    # every update an event: the tiny target answers within the default 2 s between events
    monkeypatch.setenv(pm.EVENT_INTERVAL_ENV, "0")
    src = tmp_path / "conv.jsonl"
    rows = [{"id": str(i), "messages": [{"role": "user", "content": f"Count to {i}."},
                                        {"role": "assistant", "content": "old"}]} for i in range(5)]
    rows.append({"id": "multi", "messages": [{"role": "user", "content": "One?"}, {"role": "assistant", "content": "1"},
                                             {"role": "user", "content": "Two?"}, {"role": "assistant", "content": "2"}]})
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    s = RegenerateSettings(sources=[str(src)], max_conversations=6, max_tokens=16, conversations_per_batch=4,
                           engine={"max_model_len": 256, "in_process": True})  # the spawned layout: tests/e2e
    res = run_regenerate(s, qwen3_target, tmp_path / "regen.jsonl")
    assert res.counts["regenerated"] == 6
    got = [e for e in events() if e["event"] == "progress"]
    assert got and all(e["name"] == "regenerate" and e["unit"] == "conversations" for e in got)
    assert [e["done"] for e in got] == sorted(e["done"] for e in got)
    assert got[-1]["finished"] and got[-1]["done"] == got[-1]["total"] == 6
    # progress arrived while the engine worked: an event before the last one, with tokens metered. (On
    # a fast CPU the tiny target finishes a whole batch between two meter readings, so an event with
    # 0 < done < 6 or a part-metered batch is not guaranteed: seen on an AVX-512 machine.)
    early = [e for e in got if not e["finished"]]
    assert early and early[0]["time"] < got[-1]["time"] and any(e.get("work_done", 0) > 0 for e in early), got
    # the token budget (6 first turns + the second turn unless the first reply was empty, 16 tokens each),
    # metered and settled at the end
    assert got[-1]["work_total"] in (6 * 16, 7 * 16) and got[-1]["work_done"] == got[-1]["work_total"]
    assert got[-1]["work_unit"] == "tokens"
    err = capsys.readouterr().err
    assert "[peagle] regenerate: 6/6 conversations (100%)" in err and pm.MARKER not in err
    # the display, fed the events as they came (a poll per event), shows a line for each
    replay, out = tmp_path / "replay.jsonl", io.StringIO()
    display = _Display(replay, out, t0=got[0]["time"] - got[0]["elapsed_s"], progress_every_s=0,
                       clock=lambda: json.loads(replay.read_text().splitlines()[-1])["time"])
    for e in got:
        with open(replay, "a") as fh:
            fh.write(json.dumps(e) + "\n")
        display.poll()
    shown = out.getvalue().splitlines()
    assert len(shown) == len(got) and "    regenerate: 6/6 conversations (100%), " in shown[-1]
    print("display lines:\n" + out.getvalue() + "child progress as printed:\n" + err)  # shown with -s
