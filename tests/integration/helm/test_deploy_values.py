"""Deploy and pipeline values are checked where they enter: ``peagle deploy`` arguments, the chart's
schema (Helm itself, so ``helm install --set ...`` fails too) and the cluster profile.

The Python rules (peagle.deploy.values) and the schema's ``definitions`` must be the same rules: the
first test compares them, the second runs the same good and bad examples through both.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import helm_python as helm
import pytest
import yaml

from support.k8s_schemas import ROOT
from peagle.config import ConfigError
from peagle.deploy import RenderError, render, values_for
from peagle.deploy import values as rules
from peagle.deploy.cli import main as deploy_main
from peagle.deploy.render import deep_merge
from peagle.pipeline.__main__ import main as pipeline_main
from peagle.pipeline.profile import load_profile

# This tier: the chart's schema and templates through the Helm SDK

CHART = ROOT / "charts" / "peagle-serving"
SCHEMA = json.loads((CHART / "values.schema.json").read_text())
DIGEST = "sha256:" + "0123456789abcdef" * 4
DC = {"storage": {"type": "dataConnection", "dataConnection": {"name": "aws-connection-models", "path": "runs/1/"}}}


def test_schema_definitions_are_the_python_rules():
    assert SCHEMA["definitions"] == {name: rule.schema() for name, rule in rules.RULES.items()}


# rule -> (where the chart takes such a value, good examples, bad examples)
def _at(path: str, value, base: dict | None = None) -> dict:
    out = json.loads(json.dumps(base or DC))
    node = out
    *parents, leaf = path.split(".")
    for p in parents:
        node = node.setdefault(p, {})
    node[leaf] = value
    return out


PVC = {"storage": {"type": "pvc", "pvc": {"claimName": "models"}}}
URI = {"storage": {"type": "uri", "uri": {"uri": "s3://b/p"}}}
EXAMPLES = {
    "imageRepository": (lambda v: _at("image.repository", v),
                        ["quay.io/peagle/peagle-vllm", "vllm/vllm-openai", "localhost:5000/a/b", "registry.example/x",
                         "my-registry.io:443/team/img_name", "a__b/c--d", "[fd00::1]:5000/x", "Registry.Example/x"],
                        ["quay.io/Peagle/vllm", "UPPER/x", "quay.io/x y", "quay.io/x\n", "quay.io/x/", "/x",
                         "quay.io//x", "a_/b", "x:1", "a" * 256]),
    "imageTag": (lambda v: _at("image.tag", v),
                 ["0.1.0", "v0.9.1-cpu", "latest", "_x", "A" * 128],
                 ["0.1.0\nfoo", "-rc1", ".x", "1 2", "a:b", "a/b", "A" * 129]),
    "imageDigest": (lambda v: _at("image.digest", v),
                    [DIGEST, "sha512:" + "ab" * 64, "multihash+base58:" + "0" * 32],
                    ["sha256:xyz", "sha256:" + "0" * 31, "256:" + "0" * 64, DIGEST + "\n", "sha256" + "0" * 64]),
    "objectName": (lambda v: _at("fullnameOverride", v),
                   ["qwen3-peagle", "a", "x" * 53],
                   ["Qwen3", "3b-model", "a-", "a_b", "a.b", "x" * 54, "a\nb"]),
    "dnsLabel": (lambda v: _at("nameOverride", v),
                 ["peagle", "3b", "a-b"], ["A", "a.b", "-a", "x" * 64, "a\n"]),
    "dnsSubdomain": (lambda v: _at("storage.dataConnection.name", v),
                     ["aws-connection-models", "a.b-c.d", "0a"], ["a..b", "A", "a_b", ".a", "a.", "x" * 254, "a\n"]),
    "labelKey": (lambda v: _at("kserve.labels", {v: "x"}),
                 ["team", "app.kubernetes.io/name", "example.com/Team_1", "a.b"],
                 ["team\n", "/team", "a/b/c", "Example.com/team", "-team", "t" * 64, "a b"]),
    "labelValue": (lambda v: _at("kserve.labels", {"team": v}),
                   ["", "ml", "A.b_c-1", "x" * 63], ["a b", "-a", "a-", "x" * 64, "ml\n"]),
    "resourceName": (lambda v: _at("gpu.resourceName", v),
                     ["nvidia.com/gpu", "amd.com/gpu", "gpu.intel.com/i915"],
                     ["gpu", "nvidia.com/", "nvidia.com/gpu\n", "Nvidia.com/gpu", "nvidia.com/g/pu"]),
    "quantity": (lambda v: _at("shm.sizeLimit", v),
                 ["16Gi", "100m", "1.5G", "4", ".5", "1e3", "2E"], ["16GB", "16 Gi", "-1", "Gi", "16Gi\n", "1K"]),
    "objectPrefix": (lambda v: _at("storage.dataConnection.path", v),
                     ["runs/1/", "runs/1", "a/.b/..c/...", "with space/x"],
                     ["../other/", "runs/1\n/", "/runs/1", "a//b", ".", "a/./b", "a/..", "a\\b", "a\tb"]),
    "volumePath": (lambda v: _at("storage.pvc.path", v, PVC),
                   ["", "/", "runs/7/", "/runs/7/", "a/..b"], ["../x", "/../x", "a//b", "runs\n", "./a"]),
    "storageUri": (lambda v: _at("storage.uri.uri", v, URI),
                   ["s3://bucket/runs/1", "pvc://claim/a", "https://host/x?y=1", "gs://b"],
                   ["s3://b/a b", "s3://b/a\n", "S3://b", "bucket/x", "3s://b"]),
    "text": (lambda v: _at("kserve.displayName", v), ["", "Qwen3 8B · P-EAGLE", "a/b:c"], ["a\nb", "a\tb", "\x7f"]),
}


def test_every_rule_has_examples():
    assert set(EXAMPLES) == set(rules.RULES)


@pytest.mark.parametrize("rule", sorted(EXAMPLES))
def test_python_rule_and_helm_schema_agree(rule):
    """Each example: the Python rule and Helm's schema validation give the same verdict, the expected one."""
    chart = helm.Chart.load(str(CHART))
    place, good, bad = EXAMPLES[rule]
    for value, ok in [(v, True) for v in good] + [(v, False) for v in bad]:
        try:
            rules.check(rule, value)
            python_ok = True
        except rules.InvalidValue:
            python_ok = False
        try:
            chart.validate_schema(place(value))
            helm_ok = True
        except helm.HelmValuesError:
            helm_ok = False
        assert (python_ok, helm_ok) == (ok, ok), (rule, value)


def test_image_references_parse_into_the_charts_parts():
    assert rules.parse_image("quay.io/peagle/peagle-vllm:0.1.0") == ("quay.io/peagle/peagle-vllm", "0.1.0", "")
    assert rules.parse_image("localhost:5000/vllm@" + DIGEST) == ("localhost:5000/vllm", "", DIGEST)
    assert rules.parse_image("r.io/v:1@" + DIGEST) == ("r.io/v", "1", DIGEST)
    for bad, why in [("quay.io/x:1\nfoo", r"control character \\n"), ("quay.io/x :1", "a space"),
                     ("quay.io/X:1", "lower case"), ("quay.io/x", "neither a tag nor a digest"),
                     ("localhost:5000/x", "neither a tag nor a digest")]:
        with pytest.raises(rules.InvalidValue, match=why):
            rules.parse_image(bad)


def container_image(objs: list[dict]) -> str:
    runtime = next(o for o in objs if o["kind"] == "ServingRuntime")
    return runtime["spec"]["containers"][0]["image"]


def test_digest_images_render_with_and_without_a_tag():
    for ref in ("quay.io/peagle/peagle-vllm@" + DIGEST, "quay.io/peagle/peagle-vllm:0.2@" + DIGEST):
        objs = render(values_for(data_connection="aws-connection-models", path="runs/1/", image=ref), "p", "ml", CHART)
        assert container_image(objs) == ref
    # the plain Deployment's fetcher: the main digest for the main repository, its own tag for its own
    objs = render(values_for(mode="deployment", data_connection="c", path="runs/1/", image="q.io/v@" + DIGEST),
                  "p", "ml", CHART)
    init = next(o for o in objs if o["kind"] == "Deployment")["spec"]["template"]["spec"]["initContainers"][0]
    assert init["image"] == "q.io/v@" + DIGEST
    objs = render(values_for(mode="deployment", data_connection="c", path="runs/1/", image="q.io/v@" + DIGEST,
                             extra_values=[{"fetch": {"image": {"repository": "q.io/fetch", "tag": "2"}}}]),
                  "p", "ml", CHART)
    init = next(o for o in objs if o["kind"] == "Deployment")["spec"]["template"]["spec"]["initContainers"][0]
    assert init["image"] == "q.io/fetch:2"
    with pytest.raises(RenderError, match="needs a tag or a digest"):
        render(values_for(mode="deployment", data_connection="c", image="q.io/v@" + DIGEST,
                          extra_values=[{"fetch": {"image": {"repository": "q.io/fetch"}}}]), "p", "ml", CHART)


@pytest.mark.parametrize("sets, message", [
    ("image.tag=0.1.0\nfoo", "/image/tag"),
    ("image.repository=Quay.io/Peagle/vllm", "/image/repository"),
    ("storage.dataConnection.path=../other-run/", "/storage/dataConnection/path"),
    ("storage.dataConnection.name=Aws_Connection", "/storage/dataConnection/name"),
    ("kserve.labels.team=a b", "/kserve/labels/team"),
    ("resources.limits.memory=48GB", "/resources/limits/memory"),
])
def test_helm_set_values_fail_at_render(sets, message):
    """What `helm install --set` would hand the chart: the schema refuses it before any template runs."""
    with pytest.raises(RenderError, match=message):
        render(deep_merge(DC, helm.parse_set_string(sets)), "p", "ml", CHART)


def test_kserve_host_label_of_name_and_namespace_fits():
    render(values_for(pvc="c"), "x" * 50, "ml", CHART)  # x*50-predictor-ml: 63 characters
    with pytest.raises(RenderError, match="host label x{51}-predictor-ml has 64 characters"):
        render(values_for(pvc="c"), "x" * 51, "ml", CHART)
    render(values_for(mode="deployment", pvc="c"), "x" * 53, "ml", CHART)  # no KServe host in deployment mode
    with pytest.raises(RenderError, match=r"name: 'x{54}' is too long \(54 characters, at most 53\)"):
        render(values_for(mode="deployment", pvc="c"), "x" * 54, "ml", CHART)
    with pytest.raises(RenderError, match="namespace: 'ML' is not a DNS-1123 label"):
        render(values_for(pvc="c"), "p", "ML", CHART)


# -- peagle deploy: the defect's values, each refused naming the flag, exit 2, nothing written

DEPLOY = ["--name", "qwen3-peagle", "-n", "ml", "--data-connection", "aws-connection-models"]


@pytest.mark.parametrize("args, message", [
    (["--path", "runs/1/", "--image", "quay.io/peagle/peagle-vllm:0.1.0\nfoo"],
     r"peagle: error: --image: 'quay.io/peagle/peagle-vllm:0.1.0\\nfoo' is not an image reference .*control "
     r"character \\n"),
    (["--path", "runs/1\n/"], r"peagle: error: --path: 'runs/1\\n/' is not a relative object-store path.*control "
     r"character \\n"),
    (["--path", "../other-run/"], r"peagle: error: --path: '../other-run/' is not a relative object-store path"),
    (["--path", "/runs/1/"], r"peagle: error: --path: '/runs/1/' is not a relative object-store path"),
    (["--path", "runs/1/", "--image", "quay.io/peagle/peagle-vllm"], "--image: .*neither a tag nor a digest"),
    (["--path", "runs/1/", "--service-account", "Bad_SA"], "--service-account: 'Bad_SA' is not a DNS-1123 subdomain"),
])
def test_deploy_cli_refuses_bad_values_naming_the_flag(args, message, tmp_path, capsys):
    out = tmp_path / "manifests"
    assert deploy_main(DEPLOY + args + ["--render-only", str(out)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert re.search(message, err), err
    assert not out.exists()


def test_deploy_cli_other_flags(tmp_path, capsys):
    out = str(tmp_path / "m")
    assert deploy_main(["--name", "Qwen3", "--pvc", "c", "--render-only", out]) == 2
    assert "peagle: error: --name: 'Qwen3' is not an InferenceService/Deployment name" in capsys.readouterr().err
    assert deploy_main(["--name", "p", "-n", "my_ns", "--pvc", "c", "--render-only", out]) == 2
    assert "peagle: error: --namespace: 'my_ns' is not a DNS-1123 label" in capsys.readouterr().err
    assert deploy_main(["--name", "p", "-n", "ml", "--pvc", "c", "--path", "../x", "--render-only", out]) == 2
    assert "peagle: error: --path: '../x' is not a path inside a volume" in capsys.readouterr().err
    assert deploy_main(["--name", "p", "-n", "ml", "--storage-uri", "s3://b/a b", "--render-only", out]) == 2
    assert "peagle: error: --storage-uri: 's3://b/a b' is not a storage URI" in capsys.readouterr().err
    # good values still render, a PVC sub-path may start at the volume root
    assert deploy_main(["--name", "p", "-n", "ml", "--pvc", "c", "--path", "/runs/7/", "--image",
                        "localhost:5000/vllm:1@" + DIGEST, "--render-only", out]) == 0
    isvc = yaml.safe_load(next(Path(out).glob("*inferenceservice*")).read_text())
    assert isvc["spec"]["predictor"]["model"]["storageUri"] == "pvc://c/runs/7"


# -- cluster profiles: refused when loaded (compile, render, submit), naming the field

@pytest.mark.parametrize("profile, message", [
    ({"images": {"vllm": "quay.io/peagle/peagle-vllm:0.1.0\nrm -rf /"}},
     r"images\.vllm: 'quay.io/peagle/peagle-vllm:0.1.0\\nrm -rf /' is not an image reference"),
    ({"images": {"trainer": "quay.io/peagle/peagle-trainer"}}, r"images\.trainer: .*neither a tag nor a digest"),
    ({"serving": {"image": "Quay.io/Peagle/VLLM:0.1.0"}}, r"serving\.image: 'Quay.io/Peagle/VLLM:0.1.0' is not"),
    ({"trainjob": {"image": "trainer image:1"}}, r"trainjob\.image: .*a space"),
    ({"accelerator": {"type": "nvidia.com/gpu\n"}}, r"accelerator\.type: .* is not an extended resource name"),
    ({"accelerator": {"node_selector": {"pool": "gpu pool"}}}, r"accelerator\.node_selector\.pool: .*label value"),
    ({"accelerator": {"tolerations": [{"key": "nvidia.com/gpu\n", "operator": "Exists"}]}},
     r"accelerator\.tolerations\.0\.key: .*label key"),
    ({"trainjob": {"node_selector": {"pool/a/b": "x"}}}, r"trainjob\.node_selector\.pool/a/b\.\[key\]: .*label key"),
    ({"trainjob": {"runtime": "Peagle_Torch"}}, r"trainjob\.runtime: .*DNS-1123 subdomain"),
    ({"trainjob": {"resources": {"requests": {"memory": "192GB"}}}},
     r"trainjob\.resources\.requests\.memory: '192GB' is not a Kubernetes quantity"),
    ({"steps": {"train": {"cpu": "16 cores"}}}, r"steps\.train\.cpu: '16 cores' is not a Kubernetes quantity"),
    ({"shm_size": "16G\n"}, r"shm_size: .*Kubernetes quantity"),
    ({"name": "../../etc/x"}, r"name: '../../etc/x' is not a DNS-1123 label"),
])
def test_profile_refuses_bad_values_naming_the_field(profile, message, tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text(yaml.safe_dump(profile))
    with pytest.raises(ConfigError, match=message):
        load_profile(p)


def test_pipeline_cli_refuses_a_bad_profile_image(tmp_path, capsys):
    p = tmp_path / "bad.yaml"
    p.write_text(yaml.safe_dump({"name": "bad", "images": {"vllm": "quay.io/peagle/peagle-vllm:0.1.0\nrm -rf /"}}))
    assert pipeline_main(["compile", "--profile", str(p), "--out", str(tmp_path / "p.yaml")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"peagle: error: cluster profile {p}: images.vllm: 'quay.io/peagle/peagle-vllm:0.1.0\\nrm")
    assert not (tmp_path / "p.yaml").exists()
    assert pipeline_main(["render", "--profile", str(p), "--out", str(tmp_path / "objs")]) == 2
    assert "images.vllm" in capsys.readouterr().err and not (tmp_path / "objs").exists()
    # the review render's own flags name what the run would deploy (a traceback before)
    assert pipeline_main(["render", "--deploy-name", "Bad_Name", "--out", str(tmp_path / "objs")]) == 2
    assert capsys.readouterr().err.startswith("peagle: error: --deploy-name: 'Bad_Name' is not an InferenceService")


def test_committed_profiles_pass():
    for p in sorted((ROOT / "pipelines" / "profiles").glob("*.yaml")):
        load_profile(p)
