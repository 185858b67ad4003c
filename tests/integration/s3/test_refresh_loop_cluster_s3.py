"""The scheduled refresh loop closes (issue #39): two consecutive scheduled runs of the refresh pipeline, with the
same schedule parameters, each promote a candidate on a stand-in cluster -- the second warm-starts from, gates
against and rolls out beside the draft the first promoted, not the draft the schedule named.

Real here: the published run and drafts and the loop history on S3 (SeaweedFS), the chart's renders (Helm SDK),
the pipeline's trigger and rollout step bodies (``peagle.pipeline.refresh_steps``), the live decision on
captured records. Stand-ins: the API server and controllers (support.fake_kube, no Kubernetes here), KServe's
webhook and who answers the requests (support.kserve_admission); the steps between trigger and rollout (select
... gate, which need vLLM: tests/e2e) are replaced by publishing a candidate draft and its lineage.json.
"""
from __future__ import annotations

import json
import os
import signal
import struct
from datetime import datetime, timedelta, timezone

import pytest

from support.fake_kube import FakeCluster
from support.kserve_admission import kserve_inferenceservice_webhook, served_split, storage_failure
from support.loop_records import lineage_doc
from support.refresh_pipeline import trigger_arguments
from support.seaweed import BUCKET, unique
from support.traffic_records import spec_decode, traffic_record, write_records
from peagle.deploy import Apis, kube
from peagle.model.target import fingerprint as target_fingerprint
from peagle.pipeline.deployment import ServingSettings, serving_objects
from peagle.pipeline.refresh_steps import load_refresh, rollout, trigger
from peagle.records.history import LoopHistory
from peagle.records.identity import identify_draft
from peagle.rollout.assemble import RolloutTerminated
from peagle.rollout.cluster import phase_record_name
from peagle.storage import open_store, publish, publish_dir

NAME, NS, DC = "qwen3-peagle", "ml", "models"
T0 = datetime(2026, 12, 1, 12, 0, tzinfo=timezone.utc)
SERVING = json.dumps({"gpus": 0, "values": {"route": {"allowUnauthenticated": True}}})
CONFIG = "trigger: {min_new_records: 40}\nrollout: {poll_s: 30, resamples: 200, ready_timeout_s: 60}\n"


def safetensors_bytes(values: list[float]) -> bytes:
    header = json.dumps({"w": {"dtype": "F32", "shape": [len(values)], "data_offsets": [0, 4 * len(values)]}})
    header += " " * (-len(header) % 8)
    return struct.pack("<Q", len(header)) + header.encode() + struct.pack(f"<{len(values)}f", *values)


def publish_files(uri: str, files: dict[str, bytes]) -> str:
    publish(open_store(uri), "", files, {"test": True}, overwrite=True)
    return uri


def draft_files(seed: float) -> dict[str, bytes]:
    return {"model.safetensors": safetensors_bytes([seed, seed + 1]), "config.json": b'{"architectures": ["x"]}'}


def predicted_fingerprint(seed: float, where) -> str:
    """The fingerprint of the candidate :func:`scheduled_run` publishes for ``seed`` (its files in ``where``)."""
    where.mkdir()
    for name, data in draft_files(seed).items():
        (where / name).write_bytes(data)
    return identify_draft(str(where)).fingerprint


class Traffic:
    """Requests answered while the rollout sleeps, split as the stand-in cluster splits them (the Route's weights),
    each captured with the draft that answered it; ``quality`` maps a draft fingerprint to its acceptance."""

    def __init__(self, log: str, cluster: FakeCluster, target: str, quality: dict[str, list[int]], rate: int = 4):
        self.log, self.cluster, self.target, self.quality, self.rate = log, cluster, target, quality, rate
        self.now = T0

    def clock(self) -> datetime:
        return self.now

    def drafts(self) -> tuple[str, str | None, int]:
        isvc = self.cluster.store[("InferenceService", NS, NAME)]
        stable = kube.fingerprint_of(isvc)
        pointer = self.cluster.store.get(("ConfigMap", NS, f"{NAME}-draft"))  # a promotion by swap's
        if pointer is not None and pointer["data"]["template"] == stable:
            stable = pointer["data"]["fingerprint"]
        phase = self.cluster.store.get(("ConfigMap", NS, phase_record_name(NAME)))
        canary = ((phase or {}).get("data") or {}).get("candidate")
        split = served_split(self.cluster.store, NS, ("Route", NAME))
        weight = sum(w for backend, w in split.items() if canary and f"-c{canary[:8]}" in backend)
        return stable, canary, weight

    def sleep(self, seconds: float) -> None:
        stable, canary, weight = self.drafts()
        records = []
        for i in range(int(seconds * self.rate)):
            draft = canary if canary and (i % 100) < weight else stable
            h = self.quality[draft]
            records.append(traffic_record(
                f"q{self.now.timestamp():.0f}-{i}", when=self.now + timedelta(seconds=i / self.rate), model="m",
                response_text="a", finish_reason="stop", target_fingerprint=self.target, draft_fingerprint=draft,
                spec_decode=spec_decode(h, 3 * sum(h), mean=2.0)))
        if records:
            write_records(None, records, uri=self.log)
        self.now += timedelta(seconds=seconds)


def scheduled_run(root: str, run_name: str, base: str, traffic: Traffic, candidate_seed: float, apis: Apis,
                  history: str, serving_settings: str = SERVING, **swap_io) -> tuple[str, str, str]:
    """One scheduled run with the schedule's fixed parameters: trigger; a candidate published as train would,
    with its lineage as gate would (passed, warm-started from the serving draft the trigger chose); the rollout
    step. Returns (the serving draft the run used, the candidate's fingerprint, the rollout's decision)."""
    traffic.sleep(30)  # new traffic since the last refresh: the trigger goes on
    uri, decision = trigger(**trigger_arguments(
        target=f"{base}/models/target", serving_draft=f"{base}/models/draft", traffic=traffic.log,
        output_root=f"{root}/refresh", run_name=run_name, config=CONFIG, rollout_routing="route",
        deploy_name=NAME, deploy_namespace=NS, data_connection=DC, rollout_min_requests=20, rollout_window_s=600),
        now=traffic.now)
    assert decision.go, decision.reasons
    run, layout = load_refresh(uri)
    serving = run.params.serving_draft
    candidate = publish_files(str(layout.draft), draft_files(candidate_seed))
    fp = identify_draft(candidate).fingerprint
    serving_id = identify_draft(serving)
    lineage = lineage_doc(
        target={"path": run.params.target, "fingerprint": traffic.target},
        base_draft={"uri": serving, "fingerprint": serving_id.fingerprint, "manifest_sha256": "a" * 64},
        candidate_draft={"uri": candidate, "fingerprint": fp, "manifest_sha256": "b" * 64},
        gate={"passed": True, "reasons": [], "report": None},
        outputs={"draft": candidate, "lineage": f"{uri}/lineage.json"})
    open_store(uri).put_bytes("lineage.json", json.dumps(lineage).encode())
    traffic.quality[fp] = [1, 3, 5, 7 + int(candidate_seed)]  # each candidate accepts more than the one before
    verdict = rollout(uri, candidate, routing="route", name=NAME, namespace=NS, mode="kserve", data_connection=DC,
                      serving=serving_settings, apis=apis, clock=traffic.clock, sleep=traffic.sleep, **swap_io)
    assert LoopHistory(history).latest("decision")["versions"]["stable"]["draft"] == serving
    return serving, fp, verdict


def deployed(seaweed_server, monkeypatch, tmp_path, serving: str = SERVING):
    """A base run published on S3 and deployed (as the default pipeline's deploy step applies it) on a stand-in
    cluster with KServe's webhook; its traffic log."""
    for k, v in seaweed_server.env(AWS_S3_BUCKET=BUCKET).items():
        monkeypatch.setenv(k, v)
    root = f"s3://{BUCKET}/{unique('loop')}"
    base = f"{root}/runs/base"
    target_dir = tmp_path / "target"
    target_dir.mkdir()
    (target_dir / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    (target_dir / "model.safetensors").write_bytes(safetensors_bytes([0.5] * 4))
    publish_dir(open_store(f"{base}/models/target"), "", target_dir, {"source": "test"}, overwrite=True)
    publish_files(f"{base}/models/draft", draft_files(0.0))
    open_store(base).put_bytes("run.json", json.dumps({"params": {"num_speculative_tokens": 3}}).encode())
    base_fp = identify_draft(f"{base}/models/draft").fingerprint
    target = target_fingerprint(target_dir)

    cluster = FakeCluster(reconcile=True)
    cluster.admission["InferenceService"] = kserve_inferenceservice_webhook
    cluster.storage_check = storage_failure  # a canary whose model cannot be fetched never serves
    apis = Apis(core=cluster, apps=cluster, custom=cluster)
    # what the default pipeline's deploy step applies (its smoke test needs a server: not here)
    kube.apply(apis, serving_objects(base, NAME, "kserve", DC, 3, ServingSettings.model_validate(json.loads(serving)),
                                     NS, draft_fingerprint=base_fp))
    log = str(tmp_path / "traffic")
    traffic = Traffic(log, cluster, target, {base_fp: [4, 4, 4, 4]})
    history = f"{log}/_loop"
    return root, base, apis, cluster, traffic, history


def test_two_scheduled_runs_close_the_loop(seaweed_server, monkeypatch, tmp_path):
    root, base, apis, cluster, traffic, history = deployed(seaweed_server, monkeypatch, tmp_path)
    base_fp = traffic.drafts()[0]

    served1, fp1, verdict1 = scheduled_run(root, "r1", base, traffic, 1.0, apis, history)
    assert (served1, verdict1) == (f"{base}/models/draft", "promote")
    assert traffic.drafts() == (fp1, None, 0)

    served2, fp2, verdict2 = scheduled_run(root, "r2", base, traffic, 2.0, apis, history)
    assert served2 == f"{root}/refresh/r1/draft", "the second run did not start from the promoted draft"
    run2, _ = load_refresh(f"{root}/refresh/r2")
    assert run2.serving_note and "the newest promotion on record serves" in run2.serving_note
    assert verdict2 == "promote" and traffic.drafts() == (fp2, None, 0)
    promotions = LoopHistory(history).all("promotion")
    assert [p["draft"]["fingerprint"] for p in promotions] == [fp1, fp2]
    assert [p["base_draft"]["fingerprint"] for p in promotions] == [base_fp, fp1]
    # the stable now serves the second candidate from two URIs that name their bucket, with the connection
    pred = cluster.store[("InferenceService", NS, NAME)]["spec"]["predictor"]
    assert [u["uri"] for u in pred["storageUris"]] == [f"{base}/models/target", f"{root}/refresh/r2/draft"]
    annotations = cluster.store[("InferenceService", NS, NAME)]["metadata"]["annotations"]
    assert annotations["opendatahub.io/connections"] == DC
    assert not [k for k in cluster.store if "-c" + fp1[:8] in k[2] or "-c" + fp2[:8] in k[2]], "a canary was left"


def test_two_scheduled_runs_promote_by_swap_and_never_restart_the_stable(seaweed_server, monkeypatch, tmp_path):
    """The same loop with the stable serving the swap endpoint (issue #41): each promotion swaps the draft in the
    stable's pods (the token from the Secret the pipeline gives the step, PEAGLE_SWAP_TOKEN), the second run's
    stable values render the draft the first promoted (the newest promotion) while the predictor still names
    the deployed one, and the InferenceService's predictor is never written."""
    from support.pod_swaps import PodEndpoints

    serving = json.dumps({"gpus": 0, "values": {"route": {"allowUnauthenticated": True}, "swap": {
        "enabled": True, "tokenSecret": {"name": "peagle-swap"}}}})
    root, base, apis, cluster, traffic, history = deployed(seaweed_server, monkeypatch, tmp_path, serving)
    monkeypatch.setenv("PEAGLE_SWAP_TOKEN", "t0ken")
    pods = PodEndpoints(cluster, NS, "t0ken")
    io = {"pod_swap_io": {"swapper": pods.swapper, "reader": pods.reader}}
    base_fp = traffic.drafts()[0]
    predictor = json.dumps(cluster.store[("InferenceService", NS, NAME)]["spec"]["predictor"], sort_keys=True)

    _, fp1, verdict1 = scheduled_run(root, "r1", base, traffic, 1.0, apis, history, serving, **io)
    assert verdict1 == "promote" and traffic.drafts() == (fp1, None, 0)
    served2, fp2, verdict2 = scheduled_run(root, "r2", base, traffic, 2.0, apis, history, serving, **io)
    assert served2 == f"{root}/refresh/r1/draft" and verdict2 == "promote" and traffic.drafts() == (fp2, None, 0)
    assert [fp for _, fp in pods.swaps] == [fp1, fp2]  # one stable pod, swapped twice
    assert json.dumps(cluster.store[("InferenceService", NS, NAME)]["spec"]["predictor"], sort_keys=True) == predictor
    pointer = cluster.store[("ConfigMap", NS, f"{NAME}-draft")]["data"]
    assert pointer == {"uri": f"{root}/refresh/r2/draft", "fingerprint": fp2, "template": base_fp}
    assert [p["draft"]["fingerprint"] for p in LoopHistory(history).all("promotion")] == [fp1, fp2]


@pytest.mark.parametrize("stop", ["sigterm", "error", "stuck"])
def test_a_rollout_step_stopped_before_its_decision_removes_its_canary(seaweed_server, monkeypatch, tmp_path, stop):
    """The step stopped by SIGTERM (the run terminated, its deadline passed), failing while it observes, or its
    canary's pod stuck (no GPU free, held by a Kueue gate: never ready within rollout.ready_timeout_s): the
    canary goes (its GPU freed, all traffic to the untouched stable) before the step ends, and no decision is
    recorded."""
    root, base, apis, cluster, traffic, history = deployed(seaweed_server, monkeypatch, tmp_path)
    base_fp = traffic.drafts()[0]
    observe = traffic.sleep
    if stop == "stuck":
        cluster.stuck = {f"{NAME}-c{predicted_fingerprint(1.0, tmp_path / 'candidate')[:8]}-predictor"}
        with pytest.raises(kube.DeployTimeout, match="not ready|did not"):
            scheduled_run(root, "r1", base, traffic, 1.0, apis, history)
        assert traffic.drafts() == (base_fp, None, 0)
        assert not [k for k in cluster.store if "-c" in k[2]], "the stuck canary was left"
        assert LoopHistory(history).all("decision") == []
        return

    def stopped(seconds):
        observe(seconds)
        if traffic.drafts()[1] is not None:  # the canary runs and has its share
            if stop == "sigterm":
                os.kill(os.getpid(), signal.SIGTERM)
            raise OSError("the traffic log could not be read")

    traffic.sleep = stopped
    with pytest.raises((RolloutTerminated, OSError)) as stopped_by:
        scheduled_run(root, "r1", base, traffic, 1.0, apis, history)
    assert isinstance(stopped_by.value, RolloutTerminated) == (stop == "sigterm")
    assert traffic.drafts() == (base_fp, None, 0)
    assert not [k for k in cluster.store if "-c" in k[2]], "the canary was left"
    assert LoopHistory(history).all("decision") == []
    assert signal.getsignal(signal.SIGTERM) is not None  # the step's handler is gone again
