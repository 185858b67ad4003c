"""What the pipeline renders with the Helm SDK: its deploy step and ``peagle pipeline render``.

* With a Kueue queue in the cluster profile, the serving objects (InferenceService; Deployment and pods in
  deployment mode) and the TrainJob carry ``kueue.x-k8s.io/queue-name``, and the pool's OpenShift AI
  hardware (3.x) or accelerator (2.x) profile goes on the InferenceService; everything validates against
  the CRDs.
* The deploy step names the draft it serves by its fingerprint (read from the publication's manifest), so the
  smoke test proves that the pipeline's own draft answered.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import yaml

from support.k8s_schemas import CRD_SETS, crd_dir, validate

from peagle.deploy.cli import served_names
from peagle.pipeline.__main__ import main as pipeline_main


QUEUE = "kueue.x-k8s.io/queue-name"


FP_LABEL = "peagle.io/draft-fingerprint"


HW_NAME = "opendatahub.io/hardware-profile-name"


HW_NAMESPACE = "opendatahub.io/hardware-profile-namespace"


ACCEL_NAME = "opendatahub.io/accelerator-name"


QUEUED = ("accelerator:\n  queue_name: gpu-queue\n  annotations:\n"
          f"    {HW_NAME}: h100\n    {HW_NAMESPACE}: redhat-ods-applications\n")


def profile_file(tmp_path: Path, text: str) -> Path:
    prof = tmp_path / "profile.yaml"
    prof.write_text("name: q\n" + text)
    return prof


def load(tmp_path: Path, text: str):
    from peagle.pipeline.profile import load_profile

    return load_profile(profile_file(tmp_path, text))


def publish_draft(run: Path, weights: bytes = b"weights") -> str:
    """A published ``<run>/models/draft`` (the files a trained draft has; the deploy step reads only its
    publication). Returns its fingerprint (:func:`peagle.records.identity.identify_draft`: the weights and config)."""
    from peagle.storage import open_store, publish_dir

    src = run.parent / f"draft-src-{hashlib.sha256(weights).hexdigest()[:8]}"
    src.mkdir(parents=True, exist_ok=True)
    (src / "config.json").write_text('{"architectures": ["Eagle3Speculator"]}')
    (src / "model.safetensors").write_bytes(weights)
    from peagle.records.identity import identify_draft

    publish_dir(open_store(str(run / "models" / "draft")), "", src, overwrite=True)
    return identify_draft(run / "models" / "draft").fingerprint


def rendered(run: Path) -> dict[str, dict]:
    return {o["kind"]: o for o in (yaml.safe_load(p.read_text()) for p in sorted((run / "deploy").glob("*.yaml")))}


def objects(profile, mode: str) -> dict[str, dict]:
    """What the deploy component renders for ``profile``: its settings travel as ``serving_json()``."""
    from peagle.pipeline.deployment import ServingSettings, serving_objects

    settings = ServingSettings.model_validate(json.loads(profile.serving_json()))
    objs = serving_objects("s3://bucket/runs/r1", "qwen3-peagle", mode, "aws-connection-peagle", 4, settings, "ml")
    return {o["kind"]: o for o in objs}


def test_the_deploy_step_queues_the_inferenceservice_and_names_the_hardware_profile(tmp_path):
    from peagle.pipeline.deployment import deploy

    crd_dir()
    run = tmp_path / "runs" / "r1"
    publish_draft(run)
    profile = load(tmp_path, QUEUED)
    assert deploy(str(run), "qwen3-peagle", "render", "aws-connection-peagle", 4, profile.serving_json(),
                  namespace="ml") == str(run / "deploy")
    objs = rendered(run)
    isvc = objs["InferenceService"]
    assert isvc["metadata"]["labels"][QUEUE] == "gpu-queue"
    assert isvc["metadata"]["annotations"][HW_NAME] == "h100"
    assert isvc["metadata"]["annotations"][HW_NAMESPACE] == "redhat-ods-applications"
    for o in objs.values():
        assert validate(o) in ("builtin", "crd", "unchecked"), o["kind"]


def test_deployment_mode_pods_carry_the_queue_label(tmp_path):
    objs = objects(load(tmp_path, QUEUED), "deployment")
    dep = objs["Deployment"]
    assert dep["metadata"]["labels"][QUEUE] == "gpu-queue"
    assert dep["spec"]["template"]["metadata"]["labels"][QUEUE] == "gpu-queue"
    assert validate(dep) == "builtin"


def test_an_accelerator_profile_2x_goes_on_the_inferenceservice_and_runtime(tmp_path):
    objs = objects(load(tmp_path, f"accelerator:\n  annotations:\n    {ACCEL_NAME}: nvidia-gpu\n"), "kserve")
    assert objs["InferenceService"]["metadata"]["annotations"][ACCEL_NAME] == "nvidia-gpu"
    assert objs["ServingRuntime"]["metadata"]["annotations"][ACCEL_NAME] == "nvidia-gpu"
    assert QUEUE not in objs["InferenceService"]["metadata"]["labels"]  # no queue set: not queued


def test_serving_values_win_and_cpu_serving_is_not_a_gpu_workload(tmp_path):
    own = load(tmp_path, QUEUED + "serving:\n  values:\n    kueue: {queueName: serving-queue}\n")
    assert objects(own, "kserve")["InferenceService"]["metadata"]["labels"][QUEUE] == "serving-queue"
    cpu = objects(load(tmp_path, QUEUED + "serving:\n  gpus: 0\n"), "kserve")["InferenceService"]["metadata"]
    assert QUEUE not in cpu["labels"] and HW_NAME not in cpu["annotations"]
    default = objects(load(tmp_path, ""), "kserve")["InferenceService"]["metadata"]
    assert QUEUE not in default["labels"] and HW_NAME not in default["annotations"]


@pytest.mark.parametrize("crds", sorted(CRD_SETS))
@pytest.mark.parametrize("mode", ["kserve", "deployment"])
def test_pipeline_render_queues_the_serving_objects(tmp_path, crds, mode, capsys):
    from peagle.pipeline.__main__ import main

    crd_dir()
    out = tmp_path / "objs"
    assert main(["render", "--out", str(out), "--profile", str(profile_file(tmp_path, QUEUED)),
                 "--deploy-mode", mode]) == 0
    objs = {o["kind"]: o for o in (yaml.safe_load(p.read_text()) for p in sorted(out.glob("*.yaml")))}
    assert objs["TrainJob"]["metadata"]["labels"][QUEUE] == "gpu-queue"
    if mode == "kserve":
        assert objs["InferenceService"]["metadata"]["labels"][QUEUE] == "gpu-queue"
        assert objs["InferenceService"]["metadata"]["annotations"][HW_NAME] == "h100"
    else:
        assert objs["Deployment"]["spec"]["template"]["metadata"]["labels"][QUEUE] == "gpu-queue"
    for o in objs.values():
        if o["apiVersion"].startswith("trainer.kubeflow.org"):
            assert validate(o, crds) == "crd", o["kind"]
        else:
            assert validate(o) in ("builtin", "crd", "unchecked"), o["kind"]


def test_the_deploy_step_fingerprints_the_published_draft(tmp_path):
    from peagle.pipeline.deployment import deploy
    from peagle.pipeline.profile import ClusterProfile

    run = tmp_path / "runs" / "r1"
    fp = publish_draft(run)
    deploy(str(run), "qwen3-peagle", "render", "aws-connection-peagle", 4, ClusterProfile().serving_json(),
           namespace="ml")
    objs = rendered(run)
    assert objs["InferenceService"]["spec"]["predictor"]["labels"][FP_LABEL] == fp
    assert f"qwen3-peagle:draft-{fp}" in served_names([objs["ServingRuntime"]])  # the name the smoke test asks for

    new_fp = publish_draft(run, b"retrained weights")  # a new draft: a new name, so a redeploy waits for it
    deploy(str(run), "qwen3-peagle", "render", "aws-connection-peagle", 4, ClusterProfile().serving_json(),
           namespace="ml")
    assert new_fp != fp
    assert rendered(run)["InferenceService"]["spec"]["predictor"]["labels"][FP_LABEL] == new_fp


def test_render_accepts_the_bounds(capsys, tmp_path):
    assert pipeline_main(["render", "--out", str(tmp_path / "a"), "--num-nodes", "256", "--num-gpus", "64",
                          "--run-id", "0f1e2d3c-aaaa-bbbb-cccc-000000000000"]) == 0
    job = next((tmp_path / "a").glob("*trainjob*.yaml")).read_text()
    assert "numNodes: 256" in job and "numProcPerNode: 64" in job


def _publish_evaluation(run: Path, report: dict) -> None:
    """A published ``<run>/evaluate`` holding ``report`` (and its schedule.json), as the evaluate step leaves it."""
    from peagle.evaluate import apply_gate
    from peagle.evaluate.report import EVALUATION_KIND
    from peagle.evaluate.run import write_report
    from peagle.stage_io import staged

    report["gate"] = apply_gate(report, speed_tolerance=0.03).as_dict()
    with staged(str(run / "evaluate"), kind=EVALUATION_KIND) as out:
        write_report(report, out)


def _speculative_config(objs: dict[str, dict]) -> dict | None:
    args = objs["ServingRuntime"]["spec"]["containers"][0]["args"]
    found = [a.split("=", 1)[1] for a in args if a.startswith("--speculative-config=")]
    return json.loads(found[0]) if found else None


def test_the_deploy_step_serves_the_schedule_the_evaluation_chose(tmp_path):
    from support.speed_reports import speed_report, speed_result

    from peagle.pipeline.deployment import deploy

    run = tmp_path / "runs" / "r1"
    publish_draft(run)
    # K=2 wins alone and beside 3 others, loses at 16: drafts up to 4 requests, then none
    _publish_evaluation(run, speed_report(speed_result({1: 0.8, 4: 0.9, 16: 1.3}, {1: 0.8, 4: 0.9, 16: 1.0})))
    deploy(str(run), "qwen3-peagle", "render", "aws-connection-peagle", 4, "", namespace="ml")
    spec = _speculative_config(rendered(run))
    assert spec["num_speculative_tokens"] == 2  # the schedule's largest K, not the trained depths (4)
    assert spec["num_speculative_tokens_per_batch_size"] == [[1, 4, 2], [5, 16, 0]]
    assert spec["method"] == "eagle3" and spec["parallel_drafting"] is True


def test_a_schedule_that_drafts_nowhere_renders_the_target_alone_and_a_bad_one_fails_at_render(tmp_path):
    from support.speed_reports import speed_result

    from peagle.deploy import RenderError, render, values_for

    nowhere = speed_result({1: 1.1, 16: 1.6}, None).schedule
    objs = {o["kind"]: o for o in render(values_for(storage_uri="s3://b/r", schedule=nowhere), "m", "ml")}
    assert _speculative_config(objs) is None
    with pytest.raises(RenderError, match="disagrees with the schedule"):
        values_for(storage_uri="s3://b/r", schedule=speed_result({1: 0.8, 16: 1.3}, None).schedule,
                   num_speculative_tokens=4)
    for bad, message in (([[2, 8, 1]], r"\[0\] starts at 2: ranges must be sorted and contiguous from 1"),
                         ([[1, 2, 1], [4, 8, 0]], r"\[1\] starts at 4"),
                         ([[1, 8, 6]], r"K=6 above speculative.numSpeculativeTokens \(4\)")):
        values = values_for(storage_uri="s3://b/r", extra_values=[{"speculative": {
            "numSpeculativeTokensPerBatchSize": bad}}])
        with pytest.raises(RenderError, match=message):
            render(values, "m", "ml")
