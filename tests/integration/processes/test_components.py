"""The pipeline's components, called as plain Python functions (what each KFP component runs), on a
tiny real target: init_run -> prepare -> extract x 2 workers -> train (pod, and through a TrainJob
whose node command really runs) -> deploy (render). evaluate and regenerate run in the kfp.local
pipeline test (tests/e2e/test_pipeline_local.py), where vLLM is started once for them."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

from peagle.config import ConfigError
from peagle.pipeline.params import config_text
from support.components import POINTERS, TINY_CONFIG, conversations, init_args, pointer

# This tier: the component chain: a real torchrun node command, Helm render


@pytest.fixture(scope="module")
def run_uri(qwen3_target, tmp_path_factory) -> str:
    from components.init_run import init_run

    tmp = tmp_path_factory.mktemp("components")
    return init_run(**init_args(tmp / "runs", qwen3_target, conversations(tmp / "conv.jsonl")))


@pytest.fixture(scope="module")
def assignments(run_uri) -> list[str]:
    from components.prepare import prepare

    return prepare(run_uri, pointer("data"))


@pytest.fixture(scope="module")
def extracted(assignments) -> list[str]:
    from components.extract import extract

    # kfp.local hands numbers over as floats: the workers must cope
    floaty = [json.dumps({**json.loads(a), "shard_index": float(json.loads(a)["shard_index"])}) for a in assignments]
    return [extract(a, pointer("hidden_states")) for a in floaty]


@pytest.fixture(scope="module")
def trained(run_uri, extracted) -> str:
    from components.train import train

    assert extracted  # the workers ran first (train reads what they published)
    return train(run_uri, "pod", 1, "", "", "job-1", pointer("draft"))


def test_components_are_thin_typed_kfp_components():
    import components
    from peagle.pipeline.profile import ClusterProfile

    built = components.build(ClusterProfile())
    for module in components.MODULES:
        name = module.__name__.rsplit(".", 1)[-1]
        comp = getattr(built, name)
        assert comp.python_func is getattr(module, name)
        image = comp.component_spec.implementation.container.image
        assert image == getattr(ClusterProfile().images, module.IMAGE)
        # thin: the body imports the library and calls it
        import inspect

        body = inspect.getsource(comp.python_func)
        assert "from peagle.pipeline" in body and len(body.splitlines()) < 25, name
    ev = built.evaluate.component_spec
    assert set(ev.outputs) == {"metrics", "report", "evaluation", "Output"}
    # every stage that publishes declares it (lineage pointer); the helper step gpu_limit does not
    lineage = {"init_run": "target_model", "regenerate": "regenerated", "prepare": "data", "extract": "hidden_states",
               "train": "draft", "evaluate": "evaluation", "deploy": "manifests"}
    for name, output in lineage.items():
        assert output in getattr(built, name).component_spec.outputs, name
    assert "List" in built.prepare.component_spec.outputs["Output"].type


def test_init_run_writes_the_resolved_settings_and_the_target(run_uri):
    from peagle.pipeline.objects import is_published, read_json

    assert run_uri.endswith("/runs/direct")
    run = read_json(run_uri + "/run.json")
    assert run["config"]["draft"]["num_depths"] == 2 and run["config"]["train"]["max_steps"] == 2
    assert run["config"]["prepare"]["max_samples"] is None  # num_samples=0: all rows
    assert run["params"]["extract_shards"] == 2
    assert is_published(run_uri + "/models/target")
    assert (Path(run_uri) / "models" / "target" / "config.json").is_file()


def test_init_run_fails_fast_on_bad_settings(qwen3_target, tmp_path):
    from components.init_run import init_run

    src = conversations(tmp_path / "c.jsonl", 2)
    bad = config_text({"draft": {"num_depths": 3}})
    with pytest.raises(ConfigError, match="'draft.num_depths'.*num_speculative_tokens"):
        init_run(**init_args(tmp_path, qwen3_target, src, config=bad))
    with pytest.raises(ConfigError, match="train.output"):
        init_run(**init_args(tmp_path, qwen3_target, src, config=config_text({"train": {"output": "/x"}})))
    with pytest.raises(ConfigError, match="needs train_mode=trainjob"):
        init_run(**init_args(tmp_path, qwen3_target, src, num_nodes=2))
    with pytest.raises(ValueError, match="deploy_mode"):
        init_run(**init_args(tmp_path, qwen3_target, src, deploy_mode="kservee"))
    with pytest.raises(ValueError, match="run name"):
        init_run(**init_args(tmp_path, qwen3_target, src, run_name="bad/name"))
    assert not (tmp_path / "direct").exists()  # nothing written before validation passed


def test_prepare_returns_one_assignment_per_extract_worker(run_uri, assignments):
    from peagle.pipeline.objects import is_published

    assert [json.loads(a) for a in assignments] == [
        {"run_uri": run_uri, "shard_index": i, "num_shards": 2} for i in range(2)]
    assert is_published(run_uri + "/data")


def test_extract_workers_complete_both_splits_and_skip_on_rerun(run_uri, assignments, extracted):
    from components.extract import extract
    from peagle.extract import HiddenStatesDataset

    summaries = [json.loads(s) for s in extracted]
    assert [s["shard_index"] for s in summaries] == [0, 1]
    assert summaries[-1]["train"]["complete"] is True  # the last worker wrote the manifest
    for split in ("train", "validation"):
        ds = HiddenStatesDataset(f"{run_uri}/hidden_states/{split}")
        assert len(ds) == sum(s[split]["rows"] for s in summaries) > 0
    again = json.loads(extract(assignments[0], pointer("hidden_states")))  # a retried worker: everything already published
    assert again["train"]["written"] == 0 and again["train"]["skipped"] > 0


def test_train_in_the_pod_publishes_a_servable_draft(run_uri, trained):
    from peagle.model import read_spec
    from peagle.pipeline.objects import is_published

    assert trained == run_uri + "/models/draft" and is_published(trained)
    spec = read_spec(trained)
    assert spec.num_depths == 2 and spec.num_layers == 1


def test_train_through_a_trainjob_runs_the_node_command(run_uri, trained):
    """The launcher path end to end, with a FAKE API server (none runs on these machines): when the
    TrainJob is created, the fake executes its command the way a Trainer node would (PET_* env)."""
    from peagle.pipeline.profile import ClusterProfile
    from peagle.pipeline.training import train
    from peagle.pipeline.trainjob import TrainJobLauncher
    from support.seaweed import free_ports
    from support.trainjob_cluster import FakeCluster, cond, run_node_command

    results = {}

    def node(job):
        env = {**os.environ, "PET_NNODES": "1", "PET_NPROC_PER_NODE": str(job["spec"]["trainer"]["numProcPerNode"]),
               "PET_NODE_RANK": "0", "PET_MASTER_ADDR": "127.0.0.1", "PET_MASTER_PORT": str(free_ports(1)[0])}
        results[job["metadata"]["name"]] = run_node_command(job, env)

    def lifecycle(name, obj, n):
        proc = results[name]
        return [cond("Complete")] if proc.returncode == 0 else [cond("Failed", "NodeFailed", proc.stderr[-300:])]

    cluster = FakeCluster(lifecycle=lifecycle, on_create=node)
    lines = []
    launcher = TrainJobLauncher(cluster, cluster, poll_interval_s=0, out=lines.append, stream_logs=False)
    draft = train(run_uri, "trainjob", cluster=ClusterProfile().trainjob_json(),
                  data_connection="aws-connection-peagle", job_id="job-1", launcher=launcher)
    assert draft == trained
    (name, proc), = results.items()
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "torch.distributed.run" in proc.stdout  # multi-node launch line: torchrun with Trainer's PET_* env
    assert name == "peagle-train-job-1" and lines[-1].endswith("complete")


def test_deploy_renders_the_serving_manifests(run_uri, trained):
    from components.deploy import deploy
    from peagle.pipeline.profile import ClusterProfile

    where = deploy(run_uri, "tiny-draft", "render", "aws-connection-peagle", 2, ClusterProfile().serving_json(),
                   pointer("manifests"))
    assert where == run_uri + "/deploy"
    docs = {p.name: yaml.safe_load(p.read_text()) for p in Path(where).glob("*.yaml")}
    isvc = next(d for d in docs.values() if d["kind"] == "InferenceService")
    assert isvc["metadata"]["name"] == "tiny-draft"
    # the data connection serves <run>/models, which holds target/ and draft/
    assert isvc["spec"]["predictor"]["model"]["storage"] == {"key": "aws-connection-peagle",
                                                             "path": (run_uri + "/models").lstrip("/")}
    runtime = next(d for d in docs.values() if d["kind"] == "ServingRuntime")
    assert '"num_speculative_tokens":2' in json.dumps(runtime).replace('\\"', '"')
    assert deploy(run_uri, "tiny-draft", "none", "x", 2, "", pointer("manifests")) == ""
    with pytest.raises(ValueError, match="unknown deploy mode"):
        deploy(run_uri, "tiny-draft", "helm", "x", 2, "", pointer("manifests"))


def test_every_stage_declares_what_it_published_for_lineage(run_uri, extracted, trained):
    """Pointers, not copies: metadata names the prefix, its manifest's sha256 and counts."""
    import hashlib

    expect = {"target_model": "/models/target", "data": "/data", "hidden_states": "/hidden_states/train",
              "draft": "/models/draft"}
    filled = {name: [a for a in POINTERS[name] if a.metadata] for name in expect}  # failed calls record nothing
    for name, suffix in expect.items():
        artifact = filled[name][-1]
        meta = artifact.metadata
        assert meta["prefix"] == run_uri + suffix, (name, meta)
        manifest = Path(meta["prefix"]) / meta["manifest"]
        if name in ("target_model", "data"):  # (the draft and shard sets are republished by later tests)
            assert meta["manifest_sha256"] == hashlib.sha256(manifest.read_bytes()).hexdigest(), name
        assert manifest.is_file() and len(meta["manifest_sha256"]) == 64, name
        assert json.loads(Path(artifact.path).read_text()) == meta  # the artifact's file is the pointer
        assert Path(artifact.path).stat().st_size < 4096  # no data through KFP
    assert any(k.startswith("count_") and v > 0 for k, v in filled["data"][-1].metadata.items())
    assert filled["hidden_states"][-1].metadata["num_samples"] > 0
    assert filled["draft"][-1].metadata["num_objects"] >= 2 and filled["draft"][-1].metadata["train_mode"] == "pod"
    assert len(filled["target_model"][-1].metadata["target_fingerprint"]) == 64


def test_streaming_run_trains_beside_its_extract_workers(qwen3_target, tmp_path):
    """train.data_mode=streaming: the train component starts before the extract workers (as with the
    profile's train_beside_extract) and reads their shard sets as they are published."""
    import threading

    from components.extract import extract
    from components.init_run import init_run
    from components.prepare import prepare
    from components.train import train
    from peagle.pipeline.objects import is_published
    from peagle.storage import open_store

    config = {**TINY_CONFIG, "extract": {**TINY_CONFIG["extract"], "sets_per_worker": 2},
              "train": {**TINY_CONFIG["train"], "data_mode": "streaming", "stream": {"poll_interval_s": 0.2}}}
    run_uri = init_run(**init_args(tmp_path / "runs", qwen3_target, conversations(tmp_path / "conv.jsonl"),
                                   config=config_text(config), run_name="streaming"))
    shards = prepare(run_uri, pointer("data"))
    out: dict = {}
    trainer = threading.Thread(target=lambda: out.update(draft=train(run_uri, "pod", 1, "", "", "job-2",
                                                                     pointer("draft"))))
    trainer.start()
    summaries = [json.loads(extract(a, pointer("hidden_states"))) for a in shards]
    trainer.join(timeout=600)
    assert out.get("draft") == run_uri + "/models/draft" and is_published(out["draft"])
    assert [s["train"]["complete"] for s in summaries] == [False, True]
    sets = {k.split("/")[0] for k in open_store(run_uri + "/hidden_states/train").list("") if k.startswith("hs-")}
    assert sets == {"hs-00000", "hs-00001", "hs-00002", "hs-00003"}  # 2 workers x 2 sets, each published alone
