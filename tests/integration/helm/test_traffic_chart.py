"""charts/peagle-serving with traffic capture (peagle.traffic): off by default, and when on, in both modes
(KServe ServingRuntime + InferenceService, plain Deployment), the same vLLM flags, the middleware's
settings as exactly CaptureSettings' ``PEAGLE_CAPTURE_*`` variables, and S3 credentials only by a
Secret reference. ``peagle deploy`` checks the ``capture`` block in CaptureSettings' terms first.
"""
from __future__ import annotations

import json

import helm_python as helm
import pytest
import yaml

from support.k8s_schemas import ROOT, validate
from peagle.deploy import RenderError, render, values_for
from peagle.deploy import values as rules
from peagle.deploy.cli import main as deploy_main
from peagle.deploy.kube import fingerprint_of
from peagle.traffic.settings import ENV_PREFIX, CaptureSettings

# This tier: renders and lints with the Helm SDK (helm_python)

CHART = ROOT / "charts" / "peagle-serving"
SCHEMA = json.loads((CHART / "values.schema.json").read_text())
DEFAULTS = yaml.safe_load((CHART / "values.yaml").read_text())
MIDDLEWARE = "--middleware=peagle.traffic.middleware.CaptureMiddleware"
DC = {"type": "dataConnection", "dataConnection": {"name": "aws-connection-models", "path": "runs/1/"}}
S3_CAPTURE = {"enabled": True, "uri": "s3://traffic/qwen3/", "s3SecretName": "aws-connection-traffic",
              "sampleRate": 0.25, "flushIntervalSeconds": 2.5, "batchRecords": 64,
              "redact": ["default", "re:ACME-[0-9]+"]}
PVC_CAPTURE = {"enabled": True, "uri": "/var/lib/peagle/traffic", "pvc": {"claimName": "traffic", "path": "qwen3/"}}
MODES = ("kserve", "deployment")


def values(mode: str, capture: dict | None = None, **extra) -> dict:
    v = {"mode": mode, "storage": DC, **extra}
    if capture is not None:
        v["capture"] = capture
    return v


def rendered(v: dict) -> dict[str, dict]:
    return {o["kind"]: o for o in render(v, "qwen3-peagle", "ml", CHART)}


def pod_parts(objs: dict[str, dict]) -> tuple[dict, list[dict]]:
    """(the vLLM container, the pod's volumes) of either mode."""
    if "ServingRuntime" in objs:
        spec = objs["ServingRuntime"]["spec"]
        return spec["containers"][0], spec["volumes"]
    pod = objs["Deployment"]["spec"]["template"]["spec"]
    return pod["containers"][0], pod["volumes"]


def capture_env(container: dict) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container["env"] if e["name"].startswith(ENV_PREFIX)}


def as_json(raw: str):
    try:
        return json.loads(raw)
    except ValueError:
        return raw


@pytest.mark.parametrize("mode", MODES)
def test_capture_is_off_by_default(mode):
    assert DEFAULTS["capture"]["enabled"] is False
    c, volumes = pod_parts(rendered(values(mode)))
    assert capture_env(c) == {} and "envFrom" not in c
    assert not any(a.startswith("--middleware") or a == "--enable-force-include-usage" for a in c["args"])
    assert "capture" not in {v["name"] for v in volumes}
    # the per-request acceptance is in every response, capture or not (it needs a speculative config)
    assert "--per-request-spec-decode-metrics=summary" in c["args"]
    baseline, _ = pod_parts(rendered(values(mode, speculative={"enabled": False})))
    assert not any(a.startswith("--per-request-spec-decode-metrics") for a in baseline["args"])


@pytest.mark.parametrize("mode", MODES)
def test_capture_on_s3_wires_middleware_settings_and_secret(mode):
    objs = rendered(values(mode, S3_CAPTURE))
    c, volumes = pod_parts(objs)
    spec_at = next(i for i, a in enumerate(c["args"]) if a.startswith("--speculative-config="))
    assert c["args"][spec_at + 1:] == ["--per-request-spec-decode-metrics=summary", MIDDLEWARE,
                                      "--enable-force-include-usage"]
    env = capture_env(c)
    settings = CaptureSettings.from_env(env)
    label = fingerprint_of(next(o for o in objs.values() if o["kind"] in ("InferenceService", "Deployment")))
    assert len(label) == 12  # the chart's hash of where the models come from (no speculative.draftFingerprint)
    assert settings == CaptureSettings(
        enabled=True, uri="s3://traffic/qwen3/", sample_rate=0.25, flush_interval_s=2.5, batch_records=64,
        redact=["default", "re:ACME-[0-9]+"], target_dir="/mnt/models/target", draft_dir="/mnt/models/draft",
        draft_fingerprint="")  # computed from the files that answer (peagle.records.identity), not the label
    # what `peagle serve` sets, up to JSON spelling (Helm writes ["a","b"] and 1.0 as 1)
    assert {k: as_json(v) for k, v in env.items()} == {k: as_json(v) for k, v in settings.to_env().items()}
    # credentials by reference only: the Secret's keys as env, no AWS_* value anywhere
    assert c["envFrom"] == [{"secretRef": {"name": "aws-connection-traffic"}}]
    text = yaml.safe_dump(list(objs.values()))
    assert "AWS_" not in text and "capture" not in {v["name"] for v in volumes}
    for obj in objs.values():
        validate(obj)


def test_both_modes_render_the_same_args_and_env():
    kserve, _ = pod_parts(rendered(values("kserve", S3_CAPTURE)))
    deployment, _ = pod_parts(rendered(values("deployment", S3_CAPTURE)))
    assert kserve["args"] == deployment["args"] and kserve["env"] == deployment["env"]
    assert kserve["envFrom"] == deployment["envFrom"]


def test_rendered_variables_are_exactly_the_capture_settings():
    """No drift: one variable per CaptureSettings field, and chart keys for every field values may set."""
    c, _ = pod_parts(rendered(values("deployment", S3_CAPTURE)))
    assert set(capture_env(c)) == {ENV_PREFIX + f.upper() for f in CaptureSettings.model_fields}
    assert set(CaptureSettings.model_fields) == set(rules.CAPTURE_VALUES.values()) | set(rules.CAPTURE_FROM_CHART)
    assert set(SCHEMA["properties"]["capture"]["properties"]) == set(rules.CAPTURE_VALUES) | set(rules.CAPTURE_WIRING)
    assert set(DEFAULTS["capture"]) == set(rules.CAPTURE_VALUES) | set(rules.CAPTURE_WIRING)


def test_chart_defaults_and_bounds_are_capture_settings_ones():
    defaults = CaptureSettings()
    schema = SCHEMA["properties"]["capture"]["properties"]
    for key, field in rules.CAPTURE_VALUES.items():
        assert DEFAULTS["capture"][key] == getattr(defaults, field), key
        theirs = CaptureSettings.model_json_schema()["properties"][field]
        bounds = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
        chart = {k: schema[key][k] for k in bounds if k in schema[key]}
        assert {k: theirs[k] for k in bounds if k in theirs} == chart, key


@pytest.mark.parametrize("mode", MODES)
def test_capture_on_a_claim_mounts_it_read_write_at_the_uri(mode):
    objs = rendered(values(mode, PVC_CAPTURE))
    c, volumes = pod_parts(objs)
    assert {"name": "capture", "mountPath": "/var/lib/peagle/traffic", "subPath": "qwen3"} in c["volumeMounts"]
    assert {"name": "capture", "persistentVolumeClaim": {"claimName": "traffic"}} in volumes
    assert CaptureSettings.from_env(capture_env(c)).uri == "/var/lib/peagle/traffic"
    assert "envFrom" not in c
    for obj in objs.values():
        validate(obj)


@pytest.mark.parametrize("mode", MODES)
def test_records_name_the_draft_by_its_files_not_by_the_label(mode):
    """The pods carry the fingerprint they were given; the records carry the one the served files have (the
    middleware computes it from draft_dir), so a label set by hand cannot misname a record's draft."""
    objs = rendered(values(mode, S3_CAPTURE, speculative={"draftFingerprint": "0123456789ab"}))
    c, _ = pod_parts(objs)
    settings = CaptureSettings.from_env(capture_env(c))
    assert settings.draft_fingerprint == "" and settings.draft_dir == "/mnt/models/draft"
    assert fingerprint_of(next(o for o in objs.values() if o["kind"] in ("InferenceService", "Deployment"))) \
        == "0123456789ab"


def test_draft_dir_is_empty_when_no_draft_is_served():
    c, _ = pod_parts(rendered(values("deployment", S3_CAPTURE, speculative={"enabled": False})))
    assert CaptureSettings.from_env(capture_env(c)).draft_dir == ""
    assert CaptureSettings.from_env(capture_env(c)).draft_fingerprint == ""
    assert MIDDLEWARE in c["args"]


def test_lint_clean_with_capture_on():
    for v in (values("kserve", S3_CAPTURE), values("deployment", PVC_CAPTURE)):
        report = helm.lint(str(CHART), v, strict=True, kube_version="v1.30.0")
        assert report["errors"] == [], report
        assert [m for m in report["messages"] if m["severity"] >= 2] == [], report


# -- refused values: peagle deploy names the key (CaptureSettings' words); Helm alone refuses them too

@pytest.mark.parametrize("capture, message", [
    ({"enabled": True}, r"capture\.uri is required with capture\.enabled=true"),
    ({"enabled": True, "uri": "s3://traffic/q/"}, r"capture\.s3SecretName is required with an s3:// capture\.uri"),
    ({"enabled": True, "uri": "/traffic"}, r"capture\.pvc\.claimName is required with a path capture\.uri"),
    ({"enabled": True, "uri": "gs://traffic/q/", "s3SecretName": "s"}, r"capture\.uri: 'gs://traffic/q/' is not s3://"),
    ({"sampleRate": 1.5}, r"capture\.sampleRate: Input should be less than or equal to 1"),
    ({"queueRecords": 0}, r"capture\.queueRecords: Input should be greater than or equal to 1"),
    ({"retentionDays": -1}, r"capture\.retentionDays"),
    ({"uri": "s3://t/p", "bucket": "x"}, r"capture\.bucket: unknown key"),
    ({"pvc": {"claim": "x"}}, r"capture\.pvc\.claim: unknown key"),
    ({"s3SecretName": "Aws_Connection"}, r"capture\.s3SecretName: 'Aws_Connection' is not a DNS-1123 subdomain"),
])
def test_bad_capture_values_are_refused_naming_the_key(capture, message):
    v = values("kserve", capture)
    with pytest.raises(RenderError, match=message):
        render(v, "qwen3-peagle", "ml", CHART)
    chart = helm.Chart.load(str(CHART))
    with pytest.raises(helm.HelmError):  # helm install: the schema or the template's check
        chart.render(v, name="qwen3-peagle", namespace="ml")


def test_helm_template_names_the_missing_value():
    chart = helm.Chart.load(str(CHART))
    for mode in MODES:
        with pytest.raises(helm.HelmError, match=r"capture\.uri is required"):
            chart.render(values(mode, {"enabled": True}), name="p", namespace="ml")
        with pytest.raises(helm.HelmError, match=r"capture\.s3SecretName is required"):
            chart.render(values(mode, {"enabled": True, "uri": "s3://t/p"}), name="p", namespace="ml")
        with pytest.raises(helm.HelmError, match=r"vllm\.env: PEAGLE_CAPTURE_URI is set by the chart"):
            chart.render(values(mode, vllm={"env": [{"name": "PEAGLE_CAPTURE_URI", "value": "/x"}]}),
                         name="p", namespace="ml")


def test_deploy_cli_turns_capture_on(tmp_path, capsys):
    out = tmp_path / "m"
    base = ["--name", "qwen3-peagle", "-n", "ml", "--mode", "deployment", "--data-connection", "aws-connection-models",
            "--path", "runs/1/"]
    assert deploy_main(base + ["--capture", "s3://traffic/qwen3/", "--capture-secret", "aws-connection-models",
                               "--set", "capture.batchRecords=64", "--set-json", "capture.sampleRate=0.5",
                               "--render-only", str(out)]) == 0
    dep = yaml.safe_load(next(out.glob("*-deployment-*")).read_text())
    c = dep["spec"]["template"]["spec"]["containers"][0]
    assert MIDDLEWARE in c["args"] and c["envFrom"] == [{"secretRef": {"name": "aws-connection-models"}}]
    assert CaptureSettings.from_env(capture_env(c)).sample_rate == 0.5
    capsys.readouterr()
    assert deploy_main(base + ["--capture", "s3://traffic/qwen3/", "--render-only", str(tmp_path / "n")]) == 2
    assert "peagle: error: capture.s3SecretName is required" in capsys.readouterr().err
    assert deploy_main(base + ["--capture", "traffic/", "--render-only", str(tmp_path / "n")]) == 2
    err = capsys.readouterr().err
    assert "peagle: error: --capture: 'traffic/' is not s3://bucket/prefix or an absolute path" in err
    assert not (tmp_path / "n").exists()


def test_values_for_maps_capture_arguments():
    v = values_for(pvc="models", capture_uri="s3://t/p", capture_secret="dc")
    assert v["capture"] == {"enabled": True, "uri": "s3://t/p", "s3SecretName": "dc"}
    assert "capture" not in values_for(pvc="models")
    # s3:///prefix: the data connection's AWS_S3_BUCKET (peagle.storage), credentials from the same Secret
    c, _ = pod_parts(rendered(values("kserve", {"enabled": True, "uri": "s3:///traffic/", "s3SecretName": "dc"})))
    assert c["envFrom"] == [{"secretRef": {"name": "dc"}}]
