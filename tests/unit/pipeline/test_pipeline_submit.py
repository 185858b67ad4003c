"""``peagle pipeline submit`` (src/peagle/pipeline/submit.py): the kfp client and environment it uses, a bad
host or a server that never answers as a clear error naming it, and every parameter (and the config file)
validated locally, before anything connects."""
from __future__ import annotations

import re
import socket
import threading
import time
from pathlib import Path

import pytest

from peagle.pipeline.__main__ import main as pipeline_main


def _closed_port() -> int:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def package(tmp_path) -> Path:
    pkg = tmp_path / "p.yaml"  # submit with --package compiles nothing
    pkg.write_text("x")
    return pkg


def submit(capsys, package, host, *params, config=None) -> tuple[int, str]:
    argv = ["submit", "--host", host, "--package", str(package)]
    for p in params:
        argv += ["--param", p]
    if config is not None:
        argv += ["--config", str(config)]
    code = pipeline_main(argv)
    return code, capsys.readouterr().err


def test_submit_to_a_closed_port_is_a_clear_error_naming_the_host(capsys, package):
    port = _closed_port()
    code, err = submit(capsys, package, f"http://127.0.0.1:{port}", "target=s3:///m")
    assert code == 2, err
    assert err.startswith("peagle: error:") and f"127.0.0.1:{port}" in err and "Traceback" not in err


@pytest.mark.parametrize("host", ["ftp://127.0.0.1:21", "file:///etc/passwd", "127.0.0.1:8888", "http://"])
def test_submit_refuses_a_host_that_is_not_an_http_url_before_connecting(capsys, package, host, monkeypatch):
    def no_connection(*a, **kw):
        raise AssertionError("connected although the host is not an http(s) URL")

    monkeypatch.setattr(socket, "create_connection", no_connection)
    code, err = submit(capsys, package, host, "target=s3:///m")
    assert code == 2, err
    assert err.startswith("peagle: error: --host:") and "/etc/passwd" not in err


def test_submit_to_a_server_that_never_answers_gives_up_within_its_deadline(capsys, package, monkeypatch):
    from peagle.pipeline import submit as submit_mod

    monkeypatch.setattr(submit_mod, "REQUEST_TIMEOUT_S", 0.5)
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept_and_say_nothing():
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except OSError:
                continue

    t = threading.Thread(target=accept_and_say_nothing, daemon=True)
    t.start()
    result: list = []
    host = f"http://127.0.0.1:{server.getsockname()[1]}"
    runner = threading.Thread(target=lambda: result.append(submit(capsys, package, host, "target=s3:///m")),
                              daemon=True)  # on a hang the test fails instead of hanging too
    started = time.monotonic()
    try:
        runner.start()
        runner.join(60)
        took = time.monotonic() - started
        assert not runner.is_alive(), "submit still waiting for a server that never answers"
    finally:
        stop.set()
        t.join()
        for c in held:
            c.close()
        server.close()
    code, err = result[0]
    assert code == 2 and "127.0.0.1" in err and "Traceback" not in err, err
    # the message says how many requests were sent in how long, not only the limit of one request
    said = re.search(r"no answer within 0.5s; gave up after (\d+) requests? in ([\d.]+)s", err)
    assert said and float(said.group(2)) <= took, (err, took)


@pytest.mark.parametrize("param, named", [
    ("num_gpus=100", "num_gpus"),
    ("num_gpus=two", "num_gpus"),
    ("num_nodes=0", "num_nodes"),
    ("num_speculative_tokens=99", "num_speculative_tokens"),
    ("extract_shards=-1", "extract_shards"),
    ("train_mode=slurm", "train_mode"),
    ("deploy_mode=helm", "deploy_mode"),
    ("deploy_name=Bad_Name", "deploy_name"),
    ("max_length=4", "max_length"),
    ("min_acceptance_length=.nan", "min_acceptance_length"),
    ("regenerate=[1]", "regenerate"),
    ("num_gpus_per_node=2", "num_gpus_per_node"),  # not a pipeline parameter
    ("run_name=a/b", "run_name"),
    ("data_connection=Not A Secret", "data_connection"),
    ("num_nodes=2", "num_nodes"),  # needs train_mode=trainjob
    ("config=train: {lr: -1}", "train.lr"),
    ("config=trian: {lr: 1}", "trian"),
])
def test_submit_validates_every_parameter_locally_naming_it(capsys, package, param, named):
    code, err = submit(capsys, package, f"http://127.0.0.1:{_closed_port()}", "target=s3:///m", param)
    assert code == 2, err
    assert named in err and "Traceback" not in err, err
    assert "127.0.0.1" not in err  # refused before any connection


def test_submit_validates_the_config_file_with_the_typed_parameters(capsys, package, tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("train: {global_batch_rows: 3}\n")
    code, err = submit(capsys, package, f"http://127.0.0.1:{_closed_port()}", "target=s3:///m", "num_gpus=2",
                       config=cfg)
    assert code == 2 and "global_batch_rows" in err and "num_gpus" in err, err
    cfg.write_text("prepare: {max_length: 512}\n")  # disagrees with the max_length parameter's default
    code, err = submit(capsys, package, f"http://127.0.0.1:{_closed_port()}", "target=s3:///m", config=cfg)
    assert code == 2 and "max_length" in err, err


def test_a_string_parameter_keeps_the_text_the_user_typed(capsys, package, monkeypatch):
    from peagle.pipeline import __main__ as cli

    seen = {}

    def fake_submit(package, arguments, **kw):
        seen.update(arguments)
        from peagle.pipeline.submit import Submitted

        return Submitted("r-1", "u")

    monkeypatch.setattr("peagle.pipeline.submit.submit", fake_submit)
    assert cli.main(["submit", "--host", "http://127.0.0.1:1", "--package", str(package), "--param",
                     "target=s3:///m", "--param", "run_name=20240101", "--param", "num_gpus=2"]) == 0
    assert seen == {"target": "s3:///m", "run_name": "20240101", "num_gpus": 2}


def test_submit_refuses_train_epochs_past_the_schema_naming_the_parameter_before_connecting(capsys, tmp_path,
                                                                                          monkeypatch):
    def no_connection(*a, **kw):
        raise AssertionError("connected although a parameter is invalid")

    monkeypatch.setattr(socket, "create_connection", no_connection)
    package = tmp_path / "p.yaml"
    package.write_text("x")
    code = pipeline_main(["submit", "--host", "http://127.0.0.1:1", "--package", str(package),
                          "--param", "target=s3:///m", "--param", "train_epochs=1000000"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("peagle: error: pipeline parameter 'train_epochs'") and "1000" in err, err
    assert "Traceback" not in err and "127.0.0.1" not in err and "'config'" not in err, err


def test_submit_uses_the_client_and_env(tmp_path, monkeypatch):
    from peagle.pipeline.submit import SubmitError, make_client, submit

    class FakeClient:  # no pipeline server on these machines
        _uihost = "https://ds-pipeline.example"

        def create_run_from_pipeline_package(self, path, arguments, run_name, experiment_name, namespace,
                                             enable_caching):
            self.args = (path, arguments, run_name, experiment_name, namespace, enable_caching)
            return type("Run", (), {"run_id": "r-123"})()

    pkg = tmp_path / "p.yaml"
    pkg.write_text("x")
    client = FakeClient()
    done = submit(pkg, {"target": "s3:///m"}, client=client, experiment="e", run_name="n")
    assert done.run_id == "r-123" and done.url == "https://ds-pipeline.example/#/runs/details/r-123"
    assert client.args[1] == {"target": "s3:///m"} and client.args[5] is False
    for name in ("KF_PIPELINES_ENDPOINT", "KFP_HOST"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(SubmitError, match="KF_PIPELINES_ENDPOINT"):
        make_client()
    with pytest.raises(SubmitError, match="not found"):
        submit(tmp_path / "missing.yaml", {}, client=client)
