"""The data connection (src/peagle/pipeline/connection.py): every key comes from the Secret mounted as files, so
no pod waits in CreateContainerConfigError on a missing key; the first step (and the TrainJob's worker) fails
naming the missing key and the connection instead."""
from __future__ import annotations

from pathlib import Path

import pytest

from support.k8s_schemas import validate


def mounted(tmp_path: Path, **keys: str) -> Path:
    """A data connection as the kubelet mounts a Secret: one file per key."""
    d = tmp_path / "data-connection"
    d.mkdir()
    for k, v in keys.items():
        (d / k).write_text(v)
    return d


CREDENTIALS = dict(AWS_ACCESS_KEY_ID="AKIDEXAMPLE", AWS_SECRET_ACCESS_KEY="wJalrXUtnFEMI/K7MDENG",
                   AWS_S3_ENDPOINT="https://s3.example.com")


def init_run_args(**kw) -> dict:
    args = dict(output_root="s3:///peagle/runs", run_name="r1", job_id="job-1", config="", target="smollm2",
                data_source="sharegpt", num_samples=0, max_length=96, regenerate=False, num_speculative_tokens=2,
                draft_layers=1, extract_shards=1, train_mode="pod", num_gpus=1, num_nodes=1, train_epochs=1,
                train_max_steps=1, min_acceptance_length=0.0, deploy_mode="none", deploy_name="p",
                data_connection="team-bucketless")
    args.update(kw)
    return args


@pytest.fixture
def clean_s3_env(monkeypatch):
    for name in ("AWS_S3_BUCKET", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_S3_ENDPOINT",
                 "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_init_run_names_the_missing_bucket_key_and_the_connection(tmp_path, clean_s3_env, capsys):
    from peagle.errors import PeagleError
    from peagle.pipeline.steps import init_run

    clean_s3_env.setenv("PEAGLE_DATA_CONNECTION_DIR", str(mounted(tmp_path, **CREDENTIALS)))
    with pytest.raises(PeagleError) as err:
        init_run(**init_run_args())
    msg = str(err.value)
    assert "data connection 'team-bucketless'" in msg and "AWS_S3_BUCKET" in msg
    assert "output_root" in msg and "s3:///peagle/runs" in msg  # what needs the bucket
    assert "wJalrXUtnFEMI" not in msg


def test_init_run_says_when_the_connection_secret_is_missing_or_empty(tmp_path, clean_s3_env):
    from peagle.errors import PeagleError
    from peagle.pipeline.steps import init_run

    clean_s3_env.setenv("PEAGLE_DATA_CONNECTION_DIR", str(mounted(tmp_path)))  # optional volume, no Secret
    with pytest.raises(PeagleError, match=r"data connection 'team-bucketless'.*no keys.*Secret"):
        init_run(**init_run_args(output_root="s3://my-bucket/runs"))


def test_a_bucket_in_the_uri_needs_no_bucket_key(tmp_path, clean_s3_env):
    from peagle.pipeline.connection import check_data_connection

    clean_s3_env.setenv("PEAGLE_DATA_CONNECTION_DIR", str(mounted(tmp_path, **CREDENTIALS)))
    check_data_connection("team-bucketless", {"output_root": "s3://my-bucket/runs", "target": "smollm2"})
    check_data_connection("team-bucketless", {"output_root": str(tmp_path)})  # no S3 at all


def test_trainjob_pods_start_without_a_key_and_the_worker_names_it(tmp_path, clean_s3_env):
    """The TrainJob's secretKeyRefs are optional (a missing key would hold every node in
    CreateContainerConfigError); the worker then fails at once naming the key and the connection."""
    from peagle.errors import PeagleError
    from peagle.pipeline.train_worker import main as worker
    from peagle.pipeline.trainjob import DATA_CONNECTION_KEYS, TrainJobSpec, build_trainjob

    job = build_trainjob(TrainJobSpec(name="peagle-train-x", namespace="ns", run_uri="s3:///peagle/runs/x",
                                      image="img:1", data_connection="team-bucketless"))
    env = {e["name"]: e for e in job["spec"]["trainer"]["env"]}
    for key in DATA_CONNECTION_KEYS:
        assert env[key]["valueFrom"]["secretKeyRef"] == {"name": "team-bucketless", "key": key, "optional": True}
    assert env["PEAGLE_DATA_CONNECTION"] == {"name": "PEAGLE_DATA_CONNECTION", "value": "team-bucketless"}
    assert validate(job) == "crd"
    for k, v in CREDENTIALS.items():  # what the kubelet resolves: the keys the Secret has
        clean_s3_env.setenv(k, v)
    clean_s3_env.setenv("PEAGLE_DATA_CONNECTION", "team-bucketless")
    with pytest.raises(PeagleError, match=r"data connection 'team-bucketless' has no AWS_S3_BUCKET"):
        worker(["--run-uri", "s3:///peagle/runs/x"])
