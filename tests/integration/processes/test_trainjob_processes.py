"""The TrainJob launcher as a real process: a real SIGTERM (what the kubelet sends when KFP terminates the run)
to a real launcher process following a TrainJob on a stand-in API server (support.trainjob_apiserver) suspends
the job, and a retry of the step resumes it."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from support.paths import REPO
from support.trainjob_apiserver import NAME, RUNNING, api_cond, api_job, api_launcher
from peagle.pipeline.trainjob import SUSPENDED_ANNOTATION, SUSPENDED_MESSAGE_ANNOTATION

ROOT = REPO


LAUNCHER_PROCESS = """
import sys
from kubernetes import client
from peagle.pipeline.trainjob import RUN_LABEL, TrainJobError, TrainJobLauncher, TrainJobSpec, build_trainjob

cfg = client.Configuration()
cfg.host = sys.argv[1]
api = client.ApiClient(cfg)
launcher = TrainJobLauncher(client.CustomObjectsApi(api), client.CoreV1Api(api), poll_interval_s=0.2,
                            timeout_s=600, stream_logs=False)
job = build_trainjob(TrainJobSpec(name="peagle-train-abc", namespace="team-a", run_uri="s3:///peagle/runs/abc",
                                  image="quay.io/peagle/peagle-trainer:0.1.0", data_connection="aws-connection-peagle",
                                  labels={RUN_LABEL: "abc"}))
try:
    launcher.run(job)
except TrainJobError as exc:
    print(f"launcher: {type(exc).__name__}: {exc}", flush=True)
    sys.exit(3)
print("launcher: complete", flush=True)
"""


def test_the_run_terminated_mid_training_suspends_the_job_and_a_retry_resumes_it(stand_in):
    """A real SIGTERM to a real launcher process (what the kubelet sends when KFP terminates the run)."""
    server = stand_in({NAME: [{}, RUNNING]})
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-c", LAUNCHER_PROCESS, server.url], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.monotonic() + 60
        while len(server.calls("GET")) < 3:  # created, and followed while running
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the launcher never followed the job"
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 3, (out, err)
    assert "launcher: TrainJobTerminated: the step was stopped (SIGTERM)" in out
    (patch,) = server.calls("PATCH")
    assert patch[3]["spec"] == {"suspend": True}
    assert patch[3]["metadata"]["annotations"][SUSPENDED_ANNOTATION] == "terminated"
    assert server.state(NAME)["pods"] == []  # the GPUs are released

    # a retry of the step (not a terminated run) picks the job up again instead of failing or waiting
    server.timeline[NAME] = [{}, RUNNING, {"conditions": [api_cond("Complete")]}]
    server.reads[NAME] = 0
    retried, lines = api_launcher(server, poll_interval_s=0.01)  # the real clock: the job was created in real time
    assert retried.run(api_job())["metadata"]["name"] == NAME
    resume = server.calls("PATCH")[-1][3]
    assert resume["spec"] == {"suspend": False}
    assert resume["metadata"]["annotations"] == {SUSPENDED_ANNOTATION: None, SUSPENDED_MESSAGE_ANNOTATION: None}
    assert SUSPENDED_ANNOTATION not in server.objects[NAME]["metadata"].get("annotations", {})
