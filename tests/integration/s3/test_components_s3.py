"""The data-side components against a real S3 server (SeaweedFS ``weed mini``), reached the way a
pipeline pod reaches the data connection: only the OpenShift AI keys in the environment
(AWS_S3_ENDPOINT, AWS_S3_BUCKET, ...) and ``s3:///...`` URIs without a bucket."""
from __future__ import annotations

import json

import pytest

from support.seaweed import ACCESS_KEY, BUCKET, SECRET_KEY
from support.components import conversations, init_args, pointer


@pytest.fixture
def data_connection_env(seaweed_server, monkeypatch):
    for name in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_REGION", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    env = {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
           "AWS_S3_ENDPOINT": seaweed_server.endpoint, "AWS_S3_BUCKET": BUCKET, "AWS_DEFAULT_REGION": "us-east-1"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("PEAGLE_CACHE", str(seaweed_server.workdir / "cache"))
    return seaweed_server


def test_stages_exchange_only_s3_uris(qwen3_target, tmp_path, data_connection_env):
    from components.deploy import deploy
    from components.extract import extract
    from components.init_run import init_run
    from components.prepare import prepare
    from components.train import train
    from peagle.pipeline.objects import is_published, read_json

    source = conversations(tmp_path / "conv.jsonl", 8)
    run = init_run(**init_args("s3:///pipeline-test", qwen3_target, source, run_name="s3run", extract_shards=1,
                               train_max_steps=1))
    assert run == "s3:///pipeline-test/s3run"
    assert read_json(run + "/run.json")["run_uri"] == run
    assert is_published(run + "/models/target")
    data = pointer("data")
    shards = prepare(run, data)
    assert data.metadata["prefix"] == run + "/data" and len(data.metadata["manifest_sha256"]) == 64
    summaries = [json.loads(extract(s, pointer("hidden_states"))) for s in shards]
    assert summaries[0]["train"]["complete"]
    assert summaries  # train reads what the workers published
    draft = train(run, "pod", 1, "", "", "job", pointer("draft"))
    assert draft == run + "/models/draft" and is_published(draft)
    where = deploy(run, "s3-draft", "render", "aws-connection-peagle", 2, "", pointer("manifests"))
    assert is_published(where)
    keys = {o["Key"] for o in data_connection_env.client().list_objects_v2(
        Bucket=BUCKET, Prefix="pipeline-test/s3run/")["Contents"]}
    assert {"pipeline-test/s3run/run.json", "pipeline-test/s3run/models/draft/config.json",
            "pipeline-test/s3run/data/_SUCCESS", "pipeline-test/s3run/hidden_states/train/_SUCCESS"} <= keys
    # the rendered InferenceService points the data connection at the bucket-relative models prefix
    body = data_connection_env.client().get_object(
        Bucket=BUCKET, Key="pipeline-test/s3run/deploy/01-inferenceservice-s3-draft.yaml")["Body"].read().decode()
    assert "path: pipeline-test/s3run/models" in body and "key: aws-connection-peagle" in body
