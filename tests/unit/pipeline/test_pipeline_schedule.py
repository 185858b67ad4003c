"""`peagle pipeline schedule` (issue #28): a KFP recurring run of the refresh pipeline, created through the
real kfp.Client against a stand-in of the pipeline server's REST API, and the cron / interval checks."""
from __future__ import annotations

import http.server
import json
import re
import socket
import threading
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

import pytest

from peagle.config import ConfigError, shorten
from peagle.pipeline.__main__ import main as pipeline_main
from peagle.pipeline.build import compiled_path
from peagle.pipeline.schedule import interval_seconds, kfp_cron

TOKEN = "sha256~do-not-print-me"
REFRESH_PARAMS = ("target=s3:///runs/r/models/target", "serving_draft=s3:///runs/r/models/draft",
                  "traffic=s3:///traffic", "replay_fraction=0.25", "gate_margin=0.1")


class KfpStandIn:
    """Stands in for the Kubeflow Pipelines v2beta1 REST API (no KFP API server runs here), on 127.0.0.1.

    It answers what ``kfp.Client`` asks when it creates a recurring run: ``GET /apis/v2beta1/healthz``
    (``tag_name`` = :attr:`version`), ``GET /apis/v2beta1/experiments`` (the ``display_name`` EQUALS filter
    the client sends, operation 1 or "EQUALS"), ``POST /apis/v2beta1/experiments`` and
    ``POST /apis/v2beta1/recurringruns`` (answered with the body plus an id and the status its ``mode``
    gives). Every request is recorded with its JSON body and its ``Authorization`` header; anything else
    is a 404 listed in :attr:`unexpected`."""

    def __init__(self, version: str = "2.5.0", experiments: dict[str, str] | None = None):
        self.version = version
        self.experiments = dict(experiments or {})  # display name -> id
        self.requests: list[tuple[str, str, dict[str, Any] | None]] = []
        self.authorization: set[str] = set()
        self.unexpected: list[str] = []
        stand_in = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def _answer(self, method: str) -> None:
                url = urlparse(self.path)
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length)) if length else None
                stand_in.requests.append((method, url.path, body))
                stand_in.authorization.add(self.headers.get("Authorization") or "")
                code, payload = stand_in.handle(method, url.path, parse_qs(url.query), body)
                data = json.dumps(payload).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):  # noqa: N802
                self._answer("GET")

            def do_POST(self):  # noqa: N802
                self._answer("POST")

            def log_message(self, *a):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def handle(self, method: str, path: str, query: dict, body: Any) -> tuple[int, Any]:
        if (method, path) == ("GET", "/apis/v2beta1/healthz"):
            return 200, {"commit_sha": "abc", "tag_name": self.version, "multi_user": False}
        if (method, path) == ("GET", "/apis/v2beta1/experiments"):
            (predicate,) = json.loads(query["filter"][0])["predicates"]
            if (predicate["key"], predicate["operation"]) not in (("display_name", 1), ("display_name", "EQUALS")):
                self.unexpected.append(f"experiments filter {predicate}")
            name = predicate["stringValue"]
            found = [{"experiment_id": self.experiments[name], "display_name": name}] if name in self.experiments \
                else []
            return 200, ({"experiments": found, "total_size": len(found)} if found else {})
        if (method, path) == ("POST", "/apis/v2beta1/experiments"):
            self.experiments[body["display_name"]] = f"exp-{len(self.experiments) + 1}"
            return 200, {**body, "experiment_id": self.experiments[body["display_name"]]}
        if (method, path) == ("POST", "/apis/v2beta1/recurringruns"):
            status = "ENABLED" if body.get("mode") == "ENABLE" else "DISABLED"
            return 200, {**body, "recurring_run_id": "rr-1", "status": status}
        self.unexpected.append(f"{method} {path}")
        return 404, {"error": "the stand-in does not serve this", "code": 5}

    def bodies(self, method: str, path: str) -> list[dict[str, Any]]:
        return [b for m, p, b in self.requests if (m, p) == (method, path)]


@pytest.fixture
def kfp_server():
    server = KfpStandIn()
    yield server
    server.close()


@pytest.fixture
def refresh_package() -> Path:
    return compiled_path("default", "refresh")  # the committed IR YAML: nothing to compile


def schedule(capsys, host: str, *flags: str, params=REFRESH_PARAMS) -> tuple[int, str, str]:
    argv = ["schedule", "--host", host, "--token", TOKEN, *flags]
    for p in params:
        argv += ["--param", p]
    code = pipeline_main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- the recurring run kfp.Client sends -------------------------------------------------------------


def test_cron_schedule_creates_one_recurring_run_of_the_refresh(capsys, kfp_server, refresh_package):
    code, out, err = schedule(capsys, kfp_server.url, "--cron", "30 2 * * MON-FRI", "--package", str(refresh_package),
                              "--experiment", "traffic-loop")
    assert code == 0, err
    (experiment,) = kfp_server.bodies("POST", "/apis/v2beta1/experiments")  # not found by name: created
    assert experiment["display_name"] == "traffic-loop"
    (job,) = kfp_server.bodies("POST", "/apis/v2beta1/recurringruns")
    assert job["trigger"] == {"cron_schedule": {"cron": "0 30 2 * * MON-FRI"}}
    # int64 fields: kfp.Client sends JSON numbers (the server's protojson takes a number or a string)
    assert job["max_concurrency"] == 1 and job["no_catchup"] is True
    assert job["mode"] == "ENABLE" and job["experiment_id"] == "exp-1" and job["display_name"] == "peagle-refresh"
    spec = job["pipeline_spec"]["pipeline_spec"]  # the IR document, beside its platform_spec
    assert spec["pipelineInfo"]["name"] == "peagle-refresh"
    assert job["runtime_config"]["parameters"] == {
        "target": "s3:///runs/r/models/target", "serving_draft": "s3:///runs/r/models/draft",
        "traffic": "s3:///traffic", "replay_fraction": 0.25, "gate_margin": 0.1}  # as typed
    # caching off: a cached first step would replay an old trigger decision
    assert all(t["cachingOptions"] == {} for t in spec["root"]["dag"]["tasks"].values())
    assert kfp_server.unexpected == []
    assert kfp_server.authorization == {f"Bearer {TOKEN}"}  # handed to the client ...
    assert TOKEN not in out + err  # ... never printed
    assert "Kubeflow Pipelines 2.5.0" in out
    assert "scheduled recurring run rr-1 (cron '0 30 2 * * MON-FRI'" in out
    assert "one run at a time, no catch-up, enabled" in out
    assert f"{kfp_server.url}/#/recurringrun/details/rr-1" in out


def test_interval_schedule_paused_in_an_existing_experiment(capsys, kfp_server, refresh_package):
    kfp_server.experiments["loops"] = "exp-existing"
    code, out, err = schedule(capsys, kfp_server.url, "--every", "6h", "--start-paused", "--package",
                              str(refresh_package), "--experiment", "loops", "--name", "nightly refresh")
    assert code == 0, err
    assert kfp_server.bodies("POST", "/apis/v2beta1/experiments") == []  # found by name, not created again
    (job,) = kfp_server.bodies("POST", "/apis/v2beta1/recurringruns")
    assert job["trigger"] == {"periodic_schedule": {"interval_second": 21600}}
    assert (job["mode"], job["experiment_id"], job["display_name"]) == ("DISABLE", "exp-existing", "nightly refresh")
    assert (job["max_concurrency"], job["no_catchup"]) == (1, True)
    assert "every 21600s" in out and "paused" in out and TOKEN not in out + err


def test_the_refresh_is_compiled_for_the_profile_by_default(capsys, kfp_server, monkeypatch):
    monkeypatch.setenv("KF_PIPELINES_ENDPOINT", kfp_server.url)  # the host from the environment
    argv = ["schedule", "--every", "90m", "--token", TOKEN]
    for p in REFRESH_PARAMS:
        argv += ["--param", p]
    assert pipeline_main(argv) == 0, capsys.readouterr().err
    (job,) = kfp_server.bodies("POST", "/apis/v2beta1/recurringruns")
    assert job["pipeline_spec"]["pipeline_spec"]["pipelineInfo"]["name"] == "peagle-refresh"
    assert job["trigger"] == {"periodic_schedule": {"interval_second": 5400}}


def test_an_old_backend_is_refused_before_anything_is_created(capsys, refresh_package):
    server = KfpStandIn(version="2.4.0")
    try:
        code, out, err = schedule(capsys, server.url, "--cron", "0 3 * * *", "--package", str(refresh_package))
    finally:
        server.close()
    assert code == 2
    assert "Kubeflow Pipelines 2.4.0; peagle's pipeline needs >= 2.5.0" in err
    assert {(m, p) for m, p, _ in server.requests} == {("GET", "/apis/v2beta1/healthz")}  # nothing created
    assert TOKEN not in out + err


# ---- checked before anything is contacted -----------------------------------------------------------


@pytest.mark.parametrize("cron,named", [
    ("61 * * * *", "minute field has 61, out of its range 0-59"),
    ("0 24 * * *", "hour field has 24, out of its range 0-23"),
    ("0 0 0 * *", "day-of-month field has 0, out of its range 1-31"),
    ("0 0 * 13 *", "month field has 13, out of its range 1-12"),
    ("0 0 * * 7", r"day-of-week field has 7, out of its range 0-6 \(0 = Sunday\)"),
    ("*/0 * * * *", "minute field has the step '0'"),
    ("0 5-1 * * *", "hour field has the range '5-1', which runs backwards"),
    ("0 0 * FOO *", "month field has 'FOO', not a number or a name"),
    ("0 1,,2 * * *", "hour field has ''"),
    ("? * * * *", "minute field cannot be '?'"),
    ("0 3 * *", "takes 5 fields"),
    ("0 0 3 * * *", "has 6"),
    ("0 0 31 2 *", "day-of-month field '31' names no day of the month field's months '2'"),
    ("0 0 30,31 FEB *", "never run"),
    ("0 0 31 4,6,9,11 *", "never run"),
    ("0 0 31 2 */1", "never run"),  # */1 keeps robfig/cron's star bit: day-of-month AND day-of-week
    ("0 0 30 2 ?/1", "never run"),
    ("0 0 31 2 1,*/1", "never run"),  # a starred item anywhere in the list sets the bit
    ("*/\u00b2 * * * *", "minute field has the step '\u00b2'"),  # a digit to str.isdigit, not to int()
    ("0 0 " + "9" * 5000 + " * *", "day-of-month field has '9+.*', out of its range 1-31"),
    ("0 0 1 1 */" + "9" * 5000, "day-of-week field has the step '9+"),
])
def test_a_bad_cron_exits_2_naming_the_field(capsys, cron, named):
    code, out, err = schedule(capsys, f"http://127.0.0.1:{_closed_port()}", "--cron", cron)
    assert code == 2 and "--cron" in err
    assert re.search(named, err), err


@pytest.mark.parametrize("every,named", [("30s", "is 30s; the interval must be at least 60s"),
                                         ("0m", "is 0s"), ("6w", "expected a whole number and a unit"),
                                         ("h", "expected"), ("1.5h", "expected"),
                                         ("99999999d", "the interval must be at most 366d"),
                                         ("367d", "at most 366d"), ("\u0663d", "expected a whole number"),
                                         ("9" * 5000 + "d", "the interval must be at most 366d")])
def test_a_bad_interval_exits_2_naming_the_flag(capsys, every, named):
    code, out, err = schedule(capsys, f"http://127.0.0.1:{_closed_port()}", "--every", every)
    assert code == 2 and f"--every {shorten(every, 20)!r}" in err and named in err


def test_exactly_one_trigger(capsys):
    for flags in (["--cron", "0 3 * * *", "--every", "6h"], []):
        with pytest.raises(SystemExit) as exc:
            pipeline_main(["schedule", "--host", "http://127.0.0.1:1", *flags])
        assert exc.value.code == 2
        assert "--cron" in capsys.readouterr().err


def test_parameters_are_validated_as_submit_validates_them(capsys, refresh_package):
    host = f"http://127.0.0.1:{_closed_port()}"
    code, _, err = schedule(capsys, host, "--every", "1d", params=(*REFRESH_PARAMS, "replay_fraction=2"))
    assert code == 2 and "replay_fraction" in err
    code, _, err = schedule(capsys, host, "--every", "1d", params=REFRESH_PARAMS[1:])
    assert code == 2 and "needs the target" in err
    code, _, err = schedule(capsys, host, "--every", "1d", params=(*REFRESH_PARAMS, "num_gpus=2"))
    assert code == 2 and "not a parameter of the refresh pipeline" in err
    code, _, err = schedule(capsys, host, "--every", "1d", "--package", str(refresh_package))  # valid: the server
    assert code == 2 and f"cannot reach the pipeline server {host}" in err


@pytest.mark.parametrize("cron", ["*/15 * * * *", "0 9 * * mon-fri", "0 0 1,15 * ?", "5 4 * jan-mar/2 0",
                                  "0 22 * * 1-5", "0-30/10 0 * * *", "59 23 31 12 6", "0 0 29 2 *",
                                  "0 0 31 2 MON", "0 0 30/2 * *", "0 0 31 1-2 *", "0 0 31 2 */2",
                                  "0 0 */1 2 */1"])
def test_valid_crons_get_kfps_seconds_field(cron):
    assert kfp_cron(cron) == "0 " + " ".join(cron.split())


def test_intervals():
    assert [interval_seconds(t) for t in ("90m", "6h", "1d", "3600s", "60s")] == [5400, 21600, 86400, 3600, 60]
    with pytest.raises(ConfigError, match="--every"):
        interval_seconds("59s")


# ---- a server that accepts connections and never answers (in full) -----------------------------------


@pytest.fixture
def silent_server(request):
    """``(url, connections)``: a TCP server on 127.0.0.1 that accepts and never says a word, or (param
    "dribbling") starts an answer and then sends one byte of a header line every 0.1 s, for ever."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    server.settimeout(0.1)
    held: list[socket.socket] = []
    stop = threading.Event()

    def dribble(c: socket.socket) -> None:
        try:
            c.recv(65536)
            c.sendall(b"HTTP/1.1 200 OK\r\nX-Slow: ")
            while not stop.wait(0.1):
                c.sendall(b"a")
        except OSError:
            pass

    def accept() -> None:
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except OSError:
                continue
            if getattr(request, "param", "silent") == "dribbling":
                threading.Thread(target=dribble, args=(held[-1],), daemon=True).start()

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{server.getsockname()[1]}", held
    stop.set()
    t.join()
    for c in held:
        c.close()
    server.close()


@pytest.mark.parametrize("request_s, deadline_s, silent_server", [(0.3, 60.0, "silent"), (30.0, 0.5, "silent"),
                                                                  (0.3, 1.0, "dribbling")],
                         indirect=["silent_server"])
def test_a_server_that_never_answers_is_given_up_within_the_deadline_saying_what_was_tried(
        capsys, monkeypatch, silent_server, request_s, deadline_s):
    """A request that timed out is not sent again, no request outlives the deadline (not one whose answer
    comes a byte at a time either), and the message says how many requests were sent in how long (not only
    the limit of one)."""
    import time

    import kfp  # noqa: F401 - imported before the clock starts (seconds on a busy machine)

    from peagle.pipeline import submit as submit_mod

    monkeypatch.setattr(submit_mod, "REQUEST_TIMEOUT_S", request_s)
    monkeypatch.setattr(submit_mod, "DEADLINE_S", deadline_s, raising=False)
    url, connections = silent_server
    started, result = time.monotonic(), []
    worker = threading.Thread(target=lambda: result.append(schedule(capsys, url, "--cron", "0 3 * * *")), daemon=True)
    worker.start()
    worker.join(20)  # a schedule that outlives the deadline fails here rather than hang the suite
    took = time.monotonic() - started
    assert result, f"still waiting for the server after {took:.0f}s"
    code, out, err = result[0]
    assert code == 2 and url in err and "Traceback" not in err and TOKEN not in out + err, err
    said = re.search(r"gave up after (\d+) requests? in ([\d.]+)s", err)
    assert said and int(said.group(1)) == 1, err
    assert float(said.group(2)) <= min(request_s, deadline_s) + 1 and float(said.group(2)) <= took < 15, (took, err)
    assert len(connections) <= 2  # the reachability check and the one request


@pytest.mark.parametrize("namespace", [None, "ns"])  # kfp.Client asks for the healthz (retrying), or only peagle
def test_a_token_echoed_in_an_error_answer_is_never_shown_or_logged(capsys, caplog, monkeypatch, refresh_package,
                                                                    namespace):
    """A server that answers every request 500 quoting the Authorization header it got: exit 2 saying it
    answered 500, and the token is in neither the output nor a log record (kfp logs its failed healthz)."""
    import kfp

    monkeypatch.setattr(kfp.Client.get_kfp_healthz, "__defaults__", (0,))  # kfp's 5 s between its retries
    server = KfpStandIn()
    monkeypatch.setattr(server, "handle", lambda *a: (500, {"error": f"no: {sorted(server.authorization)}"}))
    try:
        code, out, err = schedule(capsys, server.url, "--cron", "0 3 * * *", "--package", str(refresh_package),
                                  *(["--namespace", namespace] if namespace else []))
    finally:
        server.close()
    assert server.authorization == {f"Bearer {TOKEN}"}
    assert code == 2 and "answered 500" in err, err
    assert TOKEN not in out + err + caplog.text and "do-not" not in out + err + caplog.text
