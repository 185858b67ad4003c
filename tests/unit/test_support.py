"""The support matrix (peagle.support): the compiled pipeline needs no newer KFP backend than declared,
``submit`` refuses an older server, and the README shows the matrix the code states."""
# No `from __future__ import annotations`: KFP reads the components' annotations as types.

import http.server
import json
import threading
from pathlib import Path

from support.paths import REPO

import pytest
import yaml

from support.kfp_features import COLLECTED, NUMBER_ACCELERATOR, OPTIONAL_SECRET_ENV, ir_features, required_backend
from peagle import support
from peagle.support import MIN_KFP_BACKEND, BackendVersionError, check_backend_version

ROOT = REPO
COMPILED = ROOT / "pipelines" / "compiled" / "peagle-default.yaml"


def features_of(path: Path):
    docs = list(yaml.safe_load_all(path.read_text()))
    return ir_features(docs[0], docs[1] if len(docs) > 1 else None)


def test_the_compiled_pipeline_needs_no_newer_backend_than_declared():
    found = features_of(COMPILED)
    assert required_backend(found) <= MIN_KFP_BACKEND, sorted((f.needs, f.name) for f in found)
    assert not {COLLECTED, OPTIONAL_SECRET_ENV, NUMBER_ACCELERATOR} & found
    # the scan sees what the pipeline does use
    names = {f.name for f in found}
    assert {"dsl.OneOf on parameters", "secret name from a pipeline parameter", "dsl.PIPELINE_JOB_ID_PLACEHOLDER",
            "accelerator count from a (string) parameter", "kubernetes.empty_dir_mount"} <= names


def test_the_scan_catches_the_features_that_need_newer_backends(tmp_path):
    """Negative controls: the three constructs the pipeline used before are found and judged too new."""
    from kfp import compiler, dsl, kubernetes

    @dsl.component(base_image="python:3.11")
    def make(x: int) -> str:
        return str(x)

    @dsl.component(base_image="python:3.11")
    def use(xs: list, n: int) -> str:
        return str(xs)

    @dsl.pipeline(name="old-ways")
    def old_ways(n: int = 1, conn: str = "c"):
        with dsl.ParallelFor([1, 2]) as i:
            t = make(x=i)
        u = use(xs=dsl.Collected(t.output), n=n)
        u.set_accelerator_type("nvidia.com/gpu").set_accelerator_limit(n)
        kubernetes.use_secret_as_env(u, secret_name=conn, secret_key_to_env={"K": "K"}, optional=True)

    out = tmp_path / "old.yaml"
    compiler.Compiler().compile(old_ways, str(out))
    found = features_of(out)
    assert {COLLECTED, OPTIONAL_SECRET_ENV, NUMBER_ACCELERATOR} <= found
    assert required_backend(found) > MIN_KFP_BACKEND


@pytest.mark.parametrize("tag,ok", [("2.5.0", True), ("v2.14.3", True), ("2.16.1-rc.1", True),
                                    ("2.4.0", False), ("2.2.0", False), ("v2.0.5", False)])
def test_backend_version_judgement(tag, ok):
    if ok:
        assert tag in check_backend_version({"tag_name": tag})
    else:
        with pytest.raises(BackendVersionError, match=r"needs >= 2\.5\.0 \(OpenShift AI >= 2\.22\)"):
            check_backend_version({"tag_name": tag})
    assert "not reported" in check_backend_version({"tag_name": "unknown", "multi_user": False})


class Healthz(http.server.BaseHTTPRequestHandler):
    tag = "2.4.0"
    runs: list = []

    def do_GET(self):  # noqa: N802
        body = json.dumps({"commit_sha": "abc", "tag_name": self.tag, "multi_user": False}).encode()
        self.send_response(200 if self.path == "/apis/v2beta1/healthz" else 404)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):  # noqa: N802
        Healthz.runs.append(self.path)
        self.send_response(500)
        self.end_headers()

    def log_message(self, *a):
        pass


def test_submit_refuses_an_old_server_before_creating_anything(tmp_path):
    """A loopback HTTP server answering like KFP's healthz (no KFP API server runs here; this stands in
    for one) and the real kfp.Client."""
    from peagle.pipeline.submit import SubmitError, make_client, submit

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Healthz)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        client = make_client(f"http://127.0.0.1:{server.server_port}")
        with pytest.raises(SubmitError, match=r"Kubeflow Pipelines 2\.4\.0; peagle's pipeline needs >= 2\.5\.0"):
            submit(COMPILED, {"target": "s3:///m"}, client=client)
        assert Healthz.runs == []  # refused before any upload or run
    finally:
        server.shutdown()


def test_readme_shows_the_matrix_the_code_states():
    readme = (ROOT / "README.md").read_text()
    assert support.markdown_table() in readme, "update the README: python -m peagle.support"


# ---- the feature scan flags a retry inside a loop (folded from test_issue25_pipeline by h3) --------------


def test_the_support_scan_flags_a_retry_inside_a_loop(tmp_path):
    from support import kfp_features
    from kfp import compiler, dsl

    from peagle.support import MIN_KFP_BACKEND

    @dsl.component(base_image="python:3.11")
    def work(x: int) -> str:
        return str(x)

    @dsl.pipeline(name="loop-retry")
    def loop_retry():
        with dsl.ParallelFor([1, 2]) as i:
            work(x=i).set_retry(3)

    out = tmp_path / "p.yaml"
    compiler.Compiler().compile(loop_retry, str(out))
    found = kfp_features.ir_features(next(yaml.safe_load_all(out.read_text())))
    assert kfp_features.LOOP_RETRY in found and kfp_features.required_backend(found) > MIN_KFP_BACKEND
    # the note on nested retries says what backs it, and the loop case is named as never honoured
    assert "rhoai-2.22" in kfp_features.NESTED_RETRY.note and "beae62fb5" in kfp_features.NESTED_RETRY.note
    assert "#12389" in kfp_features.LOOP_RETRY.note


# ---- the KServe storage choice (folded from test_issue25_cluster by h4) -------------------------------


def test_support_matrix_states_the_kserve_storage_choice():
    from peagle import support

    (row,) = [r for r in support.MATRIX if r.component == "KServe"]
    assert "kserve.openshiftAI=false" in row.supported and "storage-config" in row.why
    assert support.markdown_table() in (REPO / "README.md").read_text()
