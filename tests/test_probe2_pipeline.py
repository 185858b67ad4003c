"""Issue #29, pipeline CLI and evaluation: `pipeline submit` refuses a bad host and bad parameters
before it connects, `pipeline render` bounds its flags, `evaluate` verifies the draft (checksums,
finite weights) and derives its context length from the target before vLLM starts."""
from __future__ import annotations

import json
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


# ---- 1. the pipeline server: bad scheme, nothing listening, no answer --------------------------------


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


# ---- 2. every parameter is validated before submitting ------------------------------------------


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


def test_submitted_arguments_are_the_validated_values():
    from peagle.pipeline.params import check_arguments

    args = check_arguments({"target": "s3:///m", "num_gpus": 2.0, "min_acceptance_length": 2, "run_name": "2024",
                            "regenerate": True, "config": "train: {lr: 0.001}\n"})
    assert args == {"target": "s3:///m", "num_gpus": 2, "min_acceptance_length": 2.0, "run_name": "2024",
                    "regenerate": True, "config": "train: {lr: 0.001}\n"}
    assert type(args["num_gpus"]) is int and type(args["min_acceptance_length"]) is float


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


# ---- 3 and 4. render: the run id is a Kubernetes name, node and GPU counts are bounded ------------


@pytest.mark.parametrize("argv, flag", [
    (["--run-id", "x; y"], "--run-id"),
    (["--run-id", "X" * 10], "--run-id"),
    (["--run-id", "a" * 64], "--run-id"),
    (["--num-nodes", "-1"], "--num-nodes"),
    (["--num-nodes", "0"], "--num-nodes"),
    (["--num-nodes", "100000"], "--num-nodes"),
    (["--num-gpus", "0"], "--num-gpus"),
    (["--num-gpus", "65"], "--num-gpus"),
])
def test_render_refuses_bad_flags_naming_them(capsys, tmp_path, argv, flag):
    code = pipeline_main(["render", "--out", str(tmp_path / "objs"), *argv])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("peagle: error:") and flag in err, err
    assert not (tmp_path / "objs").exists()


def test_render_accepts_the_bounds(capsys, tmp_path):
    assert pipeline_main(["render", "--out", str(tmp_path / "a"), "--num-nodes", "256", "--num-gpus", "64",
                          "--run-id", "0f1e2d3c-aaaa-bbbb-cccc-000000000000"]) == 0
    job = next((tmp_path / "a").glob("*trainjob*.yaml")).read_text()
    assert "numNodes: 256" in job and "numProcPerNode: 64" in job


def test_trainjob_poll_interval_is_bounded(tmp_path):
    from peagle.config import ConfigError
    from peagle.pipeline.profile import load_profile

    prof = tmp_path / "p.yaml"
    prof.write_text("trainjob: {poll_interval_s: 1.0e+18}\n")
    with pytest.raises(ConfigError, match="trainjob.poll_interval_s"):
        load_profile(prof)
    prof.write_text("trainjob: {poll_interval_s: 3600}\n")
    assert load_profile(prof).trainjob.poll_interval_s == 3600


def test_build_trainjob_refuses_counts_outside_the_bounds():
    from peagle.pipeline.trainjob import TrainJobError, TrainJobSpec, build_trainjob

    base = dict(name="peagle-train-x", namespace="n", run_uri="s3://b/r", image="i:1", data_connection="c")
    for bad in ({"num_nodes": 0}, {"num_nodes": 257}, {"num_proc_per_node": 0}, {"num_proc_per_node": 65}):
        with pytest.raises(TrainJobError, match="num_nodes|num_proc_per_node"):
            build_trainjob(TrainJobSpec(**base, **bad))


# ---- 5 and 6. evaluate: the draft is verified and the context fits the target, before vLLM ---------


@pytest.fixture(scope="module")
def draft_dir(qwen3_target, tmp_path_factory) -> Path:
    from peagle.config import DraftSettings
    from peagle.model import init_draft, save_draft

    model = init_draft(str(qwen3_target), DraftSettings(num_layers=1, num_depths=2, draft_vocab_size=256))
    return save_draft(model, tmp_path_factory.mktemp("drafts") / "draft")


@pytest.fixture
def no_vllm(monkeypatch):
    """vLLM cannot run in a unit test; record what evaluate would have started it with."""
    started = []

    def fake(settings, target_dir, draft_dir, ks, workloads, raw_log=None):
        started.append(settings)
        from peagle.evaluate.run import EvaluationError

        raise EvaluationError("vLLM not started in this test")

    monkeypatch.setattr("peagle.evaluate.run.run_offline_api", fake)
    return started


def evaluate(capsys, target, draft, out, *extra) -> tuple[int, str]:
    from peagle.evaluate.__main__ import main

    code = main(["--target", str(target), "--draft", str(draft), "--out", str(out), "--prompt-sets", "code",
                 "--prompts-per-category", "1", "--temperatures", "0", "--max-tokens", "8", *extra])
    return code, capsys.readouterr().err


def _copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_evaluate_refuses_a_bit_flipped_draft_before_vllm(capsys, qwen3_target, draft_dir, tmp_path, no_vllm):
    bad = _copy(draft_dir, tmp_path / "flipped")
    weights = bad / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-7] ^= 0x10  # a weight's bit, same size: only the checksum can tell
    weights.write_bytes(bytes(data))
    code, err = evaluate(capsys, qwen3_target, bad, tmp_path / "out")
    assert code == 2 and "model.safetensors" in err and "Traceback" not in err, err
    assert no_vllm == []


def test_evaluate_refuses_a_draft_missing_a_published_file(capsys, qwen3_target, draft_dir, tmp_path, no_vllm):
    bad = _copy(draft_dir, tmp_path / "short")
    (bad / "model.safetensors").write_bytes((bad / "model.safetensors").read_bytes()[:-8])
    code, err = evaluate(capsys, qwen3_target, bad, tmp_path / "out")
    assert code == 2 and "model.safetensors" in err, err
    assert no_vllm == []


def _nan_weights(d: Path) -> str:
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(d / "model.safetensors"))
    name = sorted(n for n, t in tensors.items() if t.is_floating_point())[0]
    tensors[name].view(-1)[3] = float("nan")
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    return name


def test_evaluate_refuses_a_published_draft_with_nan_weights(capsys, qwen3_target, draft_dir, tmp_path, no_vllm):
    from peagle.storage import LocalStore, open_published, publish_dir

    bad = _copy(draft_dir, tmp_path / "nan")
    meta = dict(open_published(LocalStore(bad), "").manifest.metadata)
    name = _nan_weights(bad)
    publish_dir(LocalStore(bad), "", bad, meta, overwrite=True)  # checksums match the NaN weights
    code, err = evaluate(capsys, qwen3_target, bad, tmp_path / "out")
    assert code == 2 and name in err and "model.safetensors" in err and "NaN" in err, err
    assert no_vllm == []


def test_an_unpublished_draft_is_checked_for_finite_weights_and_said_unverified(capsys, caplog, qwen3_target,
                                                                                 draft_dir, tmp_path, no_vllm):
    plain = _copy(draft_dir, tmp_path / "plain")
    for f in ("_MANIFEST.json", "_SUCCESS"):
        (plain / f).unlink()
    code, err = evaluate(capsys, qwen3_target, plain, tmp_path / "out")
    assert code == 3 and len(no_vllm) == 1, err  # it got as far as vLLM
    assert "not checksum-verified" in caplog.text
    name = _nan_weights(plain)
    code, err = evaluate(capsys, qwen3_target, plain, tmp_path / "out2")
    assert code == 2 and name in err, err
    assert len(no_vllm) == 1


def test_a_published_draft_reaches_vllm(capsys, caplog, qwen3_target, draft_dir, tmp_path, no_vllm):
    code, err = evaluate(capsys, qwen3_target, draft_dir, tmp_path / "out")
    assert code == 3 and len(no_vllm) == 1 and "not checksum-verified" not in caplog.text, err


def test_max_model_len_defaults_to_what_fits_the_target_and_the_prompts(capsys, qwen3_target, draft_dir, tmp_path,
                                                                         no_vllm):
    limit = json.loads((qwen3_target / "config.json").read_text())["max_position_embeddings"]
    assert limit == 2048
    code, err = evaluate(capsys, qwen3_target, draft_dir, tmp_path / "out")
    assert code == 3, err
    derived = no_vllm[-1].engine.max_model_len
    assert 8 < derived <= limit  # the prompt plus the 8 generated tokens, within the target
    code, err = evaluate(capsys, qwen3_target, draft_dir, tmp_path / "out", "--max-tokens", "5000")
    assert code == 3 and no_vllm[-1].engine.max_model_len == limit, err
    code, err = evaluate(capsys, qwen3_target, draft_dir, tmp_path / "out", "--engine-max-model-len", "1024")
    assert code == 3 and no_vllm[-1].engine.max_model_len == 1024, err


def test_max_model_len_above_the_target_is_refused_naming_it(capsys, qwen3_target, draft_dir, tmp_path, no_vllm):
    n = len(no_vllm)
    code, err = evaluate(capsys, qwen3_target, draft_dir, tmp_path / "out", "--engine-max-model-len", "4096")
    assert code == 2 and "evaluate.engine.max_model_len" in err and "2048" in err, err
    assert len(no_vllm) == n


def test_max_model_len_too_short_for_a_prompt_is_refused(capsys, qwen3_target, draft_dir, tmp_path, no_vllm):
    code, err = evaluate(capsys, qwen3_target, draft_dir, tmp_path / "out", "--engine-max-model-len", "16",
                         "--system-prompt", "word " * 40)
    assert code == 2 and "evaluate.engine.max_model_len" in err, err
    assert no_vllm == []
