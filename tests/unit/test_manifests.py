"""manifests/ (kustomize): the project's pipeline server and Role, the admin overlay, the data-connection template.

Rendered with a tiny kustomize (``k8s_schemas.kustomize_build``: resources + namespace only; it
refuses other kustomization features) and, where ``kubectl`` happens to be installed, cross-checked
against ``kubectl kustomize``. Objects are validated like the chart's: built-in kinds with
kubernetes-validate (strict), the ClusterTrainingRuntime against both Trainer CRD sets and the DSPA
against its CRD, all in ../shared/crds.
"""
from __future__ import annotations

import re
import shutil
import subprocess

import pytest
import yaml

from support.k8s_schemas import CLUSTER_SCOPED, CRD_SETS, ROOT, kustomize_build, validate
from support.rbac import EXTRA_OVERLAYS, MANIFESTS, ROLLOUT_OVERLAYS, grants, role_of

NAMESPACE = "peagle"
RUNNER_SA = "pipeline-runner-dspa"


@pytest.fixture(scope="module")
def objs() -> dict[tuple[str, str], dict]:
    return {(o["kind"], o["metadata"]["name"]): o for o in kustomize_build(MANIFESTS)}


@pytest.fixture(scope="module")
def admin() -> dict[tuple[str, str], dict]:
    return {(o["kind"], o["metadata"]["name"]): o for o in kustomize_build(MANIFESTS / "admin")}


@pytest.fixture(scope="module")
def extra() -> dict[tuple[str, str], dict]:
    """The optional overlays with the rights a project admin cannot grant (rbac-extra/*)."""
    return {(o["kind"], o["metadata"]["name"]): o for d in EXTRA_OVERLAYS
            for o in kustomize_build(MANIFESTS / "rbac-extra" / d)}


@pytest.fixture(scope="module")
def runtime(admin) -> dict:
    (obj,) = [o for (kind, _), o in admin.items() if kind == "ClusterTrainingRuntime"]
    return obj


@pytest.fixture(scope="module")
def secret() -> dict:
    (obj,) = kustomize_build(MANIFESTS / "data-connection")
    return obj


def test_every_object_validates(objs, admin, runtime, secret):
    kinds = sorted(k for k, _ in objs)
    assert kinds == ["DataSciencePipelinesApplication", "Role", "RoleBinding"]
    how = {kind: validate(o) for (kind, _), o in objs.items()}
    assert how["Role"] == "builtin" and how["DataSciencePipelinesApplication"] == "crd"
    assert sorted(k for k, _ in admin) == ["ClusterRole", "ClusterRoleBinding", "ClusterTrainingRuntime"]
    for crds in CRD_SETS:  # upstream Trainer v2.3 and OpenShift AI 3.5's
        assert validate(runtime, crds) == "crd"
    assert validate(secret) == "builtin"


def test_a_project_admin_may_apply_the_project_manifests(objs, admin):
    """Namespaced objects only (no cluster admin needed); the cluster-scoped ones are the admin overlay's."""
    for (kind, name), o in objs.items():
        assert kind not in CLUSTER_SCOPED and o["metadata"]["namespace"] == NAMESPACE, (kind, name)
    for (kind, name), o in admin.items():
        assert kind in CLUSTER_SCOPED and "namespace" not in o["metadata"], (kind, name)
    assert "namespace" not in yaml.safe_load((MANIFESTS / "admin" / "kustomization.yaml").read_text())


def test_the_committed_runtime_is_the_default_profiles(runtime):
    from peagle.pipeline.build import profile_path
    from peagle.pipeline.profile import load_profile
    from peagle.pipeline.runtime import cluster_training_runtime

    profile = load_profile(profile_path("default"))
    assert runtime == cluster_training_runtime(profile), "regenerate: peagle pipeline render --profile default"
    pod = runtime["spec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    env = {e["name"]: e["value"] for e in pod["containers"][0]["env"]}
    assert env["PEAGLE_CACHE"].startswith("/scratch/") and env["TMPDIR"] == "/scratch"
    assert {"name": "scratch", "emptyDir": {"sizeLimit": "200Gi"}} in pod["volumes"]


def test_role_verbs_are_the_ones_the_code_calls(objs):
    """Every verb of the Role is one a kubernetes client call in the code needs, and no more."""
    verb_of = {"create": "create", "patch": "patch", "get": "get", "read": "get", "list": "list"}
    used = set()
    for path in ("src/peagle/pipeline/trainjob.py", "src/peagle/deploy/kube.py"):
        text = (ROOT / path).read_text()
        used |= {verb_of[m] for m in re.findall(r"\b(create|patch|get|read|list)_namespaced_\w+", text)}
        used |= {verb_of[m] for m in re.findall(r'f"(create|patch|read)_\{suffix\}"', text)}
    role = objs[("Role", "peagle-pipeline-runner")]
    granted = {v for r in role["rules"] for v in r["verbs"]}
    assert granted == used == {"create", "get", "patch", "list"}


def test_rbac_is_least_privilege(objs, admin, extra):
    rules = [r for o in (*objs.values(), *admin.values(), *extra.values()) if o["kind"] in ("Role", "ClusterRole")
             for r in o["rules"]]
    rollout = [r for d in ROLLOUT_OVERLAYS for r in role_of(MANIFESTS / "rbac-extra" / d)["rules"]]
    trainjob_delete = {"apiGroups": ["trainer.kubeflow.org"], "resources": ["trainjobs"],
                       "verbs": ["create", "get", "patch", "delete"]}
    for r in rules:
        for field in ("apiGroups", "resources", "verbs"):
            assert "*" not in r[field], r
        # delete only where a rollout removes its canary (rbac-extra/rollout*), and where the TrainJob launcher
        # removes a job Kueue would start again (rbac-extra/trainjob)
        deletes = r in rollout or r == trainjob_delete
        forbidden = {"deletecollection", "escalate", "bind", "impersonate"} | ({"delete"} if not deletes else set())
        assert not set(r["verbs"]) & forbidden, r
        assert not set(r["resources"]) & {"secrets", "roles", "rolebindings", "clusterroles"}, r
    grants: dict[tuple[str, str], set[str]] = {}
    for r in rules:
        for g in r["apiGroups"]:
            for res in r["resources"]:
                grants.setdefault((g, res), set()).update(r["verbs"] if r not in rollout else set())
    write = {"create", "get", "patch"}
    assert grants[("trainer.kubeflow.org", "trainjobs")] == write | {"delete"}
    assert grants[("serving.kserve.io", "inferenceservices")] == write
    assert grants[("serving.kserve.io", "servingruntimes")] == write
    assert grants[("", "pods/log")] == {"get"}
    assert grants[("", "pods")] == {"list"} and grants[("", "events")] == {"list"}
    assert grants[("trainer.kubeflow.org", "clustertrainingruntimes")] == {"get"}
    assert ("trainer.kubeflow.org", "trainingruntimes") not in grants  # never read
    # the cluster-wide part is read-only
    cluster = admin[("ClusterRole", "peagle-clustertrainingruntime-reader")]
    assert all(set(r["verbs"]) <= {"get"} for r in cluster["rules"])


def test_runner_may_apply_every_kind_the_serving_chart_renders(objs, extra):
    """The pipeline's deploy step applies the chart's objects (any deploy mode) as the runner: the base
    Role, plus the monitoring overlay for the monitors (metrics.monitor.enabled)."""
    import re

    from peagle.deploy.kube import BUILTIN, CUSTOM_PLURALS

    plural = {kind: res for (_, kind), res in CUSTOM_PLURALS.items()}
    plural |= {"Deployment": "deployments", "Service": "services", "ServiceAccount": "serviceaccounts"}
    roles = [objs[("Role", "peagle-pipeline-runner")], extra[("Role", "peagle-pipeline-runner-monitors")],
             extra[("Role", "peagle-pipeline-runner-rollout")], extra[("Role", "peagle-pipeline-runner-rollout-httproutes")]]
    grants: dict[tuple[str, str], set[str]] = {}
    for role in roles:
        for r in role["rules"]:
            for g in r["apiGroups"]:
                for res in r["resources"]:
                    grants.setdefault((g, res), set()).update(r["verbs"])
    for template in sorted((ROOT / "charts" / "peagle-serving" / "templates").glob("*.yaml")):
        text = template.read_text()
        for api, kind in re.findall(r"^apiVersion: (\S+)\n(?:.*\n)*?^kind: (\w+)", text, re.M):
            assert kind in plural and (kind in BUILTIN or any(k == kind for _, k in CUSTOM_PLURALS)), kind
            group = api.rpartition("/")[0]
            assert grants.get((group, plural[kind]), set()) >= {"create", "get", "patch"}, (template.name, kind)


def test_bindings_grant_the_roles_to_the_pipeline_runner(objs, admin):
    both = {**objs, **admin}
    for kind, role_kind in (("RoleBinding", "Role"), ("ClusterRoleBinding", "ClusterRole")):
        (binding,) = [o for (k, _), o in both.items() if k == kind]
        assert binding["roleRef"]["kind"] == role_kind and (role_kind, binding["roleRef"]["name"]) in both
        # kustomize's namespace rewrites only subjects named "default": replacements fill this one in.
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": RUNNER_SA, "namespace": NAMESPACE}]


def test_dspa_structure(objs, secret):
    (dspa,) = [o for (k, _), o in objs.items() if k == "DataSciencePipelinesApplication"]
    assert dspa["apiVersion"] == "datasciencepipelinesapplications.opendatahub.io/v1"
    assert RUNNER_SA == f"pipeline-runner-{dspa['metadata']['name']}"
    spec = dspa["spec"]
    assert spec["dspVersion"] == "v2"
    assert spec["apiServer"]["deploy"] is True
    assert set(spec) <= {"dspVersion", "apiServer", "database", "objectStorage", "persistenceAgent",
                         "scheduledWorkflow", "mlmd", "podToPodTLS", "mlpipelineUI"}
    ext = spec["objectStorage"]["externalStorage"]
    assert set(ext) <= {"host", "port", "scheme", "region", "bucket", "basePath", "s3CredentialsSecret", "secure"}
    assert "://" not in ext["host"] and ext["scheme"] in ("http", "https")
    creds = ext["s3CredentialsSecret"]
    assert creds["secretName"] == secret["metadata"]["name"]
    assert creds["accessKey"] in secret["stringData"] and creds["secretKey"] in secret["stringData"]
    assert ext["bucket"] == secret["stringData"]["AWS_S3_BUCKET"]
    assert secret["stringData"]["AWS_S3_ENDPOINT"].endswith(ext["host"])


def test_data_connection_template(secret):
    meta = secret["metadata"]
    assert meta["labels"] == {"opendatahub.io/dashboard": "true", "opendatahub.io/managed": "true"}
    assert meta["annotations"]["opendatahub.io/connection-type"] == "s3"
    assert meta["annotations"]["opendatahub.io/connection-type-protocol"] == "s3"
    data = secret["stringData"]
    assert set(data) == {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_S3_ENDPOINT", "AWS_S3_BUCKET",
                         "AWS_DEFAULT_REGION"}
    assert data["AWS_ACCESS_KEY_ID"].startswith("REPLACE_") and data["AWS_SECRET_ACCESS_KEY"].startswith("REPLACE_")
    assert "example.com" in data["AWS_S3_ENDPOINT"]
    # never applied together with the rest (it would overwrite real credentials)
    top = yaml.safe_load((MANIFESTS / "kustomization.yaml").read_text())
    assert "data-connection" not in top["resources"]


def test_cluster_training_runtime_runs_torchrun_locked_down(runtime):
    rt = runtime
    assert rt["metadata"]["name"] == "peagle-torch" and "namespace" not in rt["metadata"]
    assert rt["spec"]["mlPolicy"] == {"numNodes": 1, "torch": {}}
    (job,) = rt["spec"]["template"]["spec"]["replicatedJobs"]
    assert job["name"] == "node"
    pod = job["template"]["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["name"] == "node" and c["command"] == ["torchrun", "-m", "peagle.train"]
    assert c["image"].rsplit("/", 1)[-1].startswith("peagle-trainer:")
    assert pod["securityContext"] == {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]
    assert {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "16Gi"}} in pod["volumes"]


def test_image_references_agree_with_the_build_script(runtime):
    out = subprocess.run([str(ROOT / "images" / "build.sh"), "--dry-run"], capture_output=True, text=True, check=True)
    image = runtime["spec"]["template"]["spec"]["replicatedJobs"][0][
        "template"]["spec"]["template"]["spec"]["containers"][0]["image"]
    assert f"--tag {image} " in out.stdout


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl not installed (optional cross-check)")
def test_tiny_kustomize_agrees_with_kubectl_kustomize():
    for d in (MANIFESTS, MANIFESTS / "admin", MANIFESTS / "data-connection",
              *(MANIFESTS / "rbac-extra" / overlay for overlay in EXTRA_OVERLAYS)):
        r = subprocess.run(["kubectl", "kustomize", str(d)], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        ref = sorted((yaml.safe_load_all(r.stdout)), key=lambda o: (o["kind"], o["metadata"]["name"]))
        ours = sorted(kustomize_build(d), key=lambda o: (o["kind"], o["metadata"]["name"]))
        assert ours == ref


UPSTREAM_ADMIN = ROOT / "tests" / "data" / "upstream-admin-rules.yaml"


# ---- a project admin can apply manifests/: OpenShift AI's admin role resolved from its upstream rules
# (tests/data/upstream-admin-rules.yaml, sources in its header), as the API server aggregates it
# (folded from test_issue25_cluster by h4)

def upstream_roles() -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in yaml.safe_load_all(UPSTREAM_ADMIN.read_text()) if d}


def aggregated_rules(roles: dict[str, dict], name: str, seen: frozenset = frozenset()) -> list[dict]:
    """The rules of ClusterRole ``name`` with its aggregationRule resolved (recursively, as the
    clusterrole-aggregation controller does: a selected role's own aggregated rules count)."""
    role = roles[name]
    rules = list(role.get("rules") or [])
    for selector in (role.get("aggregationRule") or {}).get("clusterRoleSelectors") or []:
        for other, r in roles.items():
            labels = r["metadata"].get("labels") or {}
            if other not in seen and other != name and all(labels.get(k) == v for k, v in selector["matchLabels"].items()):
                rules += aggregated_rules(roles, other, seen | {name})
    return rules


@pytest.fixture(scope="module")
def project_admin() -> set[tuple[str, str, str]]:
    return grants(aggregated_rules(upstream_roles(), "admin"))


def test_upstream_admin_rules_name_their_sources():
    header = "".join(line for line in UPSTREAM_ADMIN.read_text().splitlines(True) if line.startswith("#"))
    for repo, path in [("kubernetes/kubernetes", "bootstrappolicy/testdata/cluster-roles.yaml"),
                       ("openshift/openshift-apiserver", "bootstrappolicy/bootstrap_cluster_roles.yaml"),
                       ("opendatahub-io/kserve", "config/overlays/odh/user-cluster-roles.yaml"),
                       ("red-hat-data-services/trainer", "manifests/rhoai/kubeflow-training-roles.yaml")]:
        assert repo in header and path in header, repo
    roles = upstream_roles()
    assert roles["admin"]["aggregationRule"] and roles["admin"]["rules"] is None
    assert {"system:aggregate-to-admin", "system:openshift:aggregate-to-edit", "kserve-edit", "training-view"} <= set(roles)


def test_the_admin_role_resolves_to_what_a_project_admin_is_known_to_hold(project_admin):
    """The aggregation resolves through edit and view (a guard against a mis-transcribed label)."""
    assert ("rbac.authorization.k8s.io", "roles", "create") in project_admin          # admin itself
    assert ("apps", "deployments", "patch") in project_admin                           # edit
    assert ("", "pods/log", "get") in project_admin                                    # view
    assert ("route.openshift.io", "routes", "patch") in project_admin                  # OpenShift edit
    assert ("serving.kserve.io", "inferenceservices", "patch") in project_admin        # kserve-edit
    assert ("trainer.kubeflow.org", "trainjobs", "get") in project_admin               # training-view
    assert ("trainer.kubeflow.org", "trainjobs", "create") not in project_admin
    assert not {t for t in project_admin if t[0] == "monitoring.coreos.com"}


def test_base_role_grants_nothing_a_project_admin_lacks(project_admin):
    """Kubernetes refuses to create a Role granting rights its creator lacks: every (group, resource,
    verb) of the base Role must be one OpenShift AI's admin holds."""
    roles = [o for o in kustomize_build(MANIFESTS) if o["kind"] == "Role"]
    assert roles
    for role in roles:
        missing = sorted(grants(role["rules"]) - project_admin)
        assert not missing, f"Role/{role['metadata']['name']} grants what a project admin lacks: {missing}"


def test_runner_may_create_a_route_with_its_own_host(objs, project_admin):
    """The chart's Route sets spec.host (route.host, routing.host). OpenShift's route admission then asks for
    a SubjectAccessReview, verb create on routes/custom-host in route.openshift.io, and refuses the Route
    without it ("you do not have permission to set the host field of the route"): openshift/library-go
    pkg/route/hostassignment/assignment.go AllocateHost, called by openshift/openshift-apiserver
    pkg/route/apiserver/registry/route/strategy.go Validate (commit 56aa2d96edd725e44ddd7ff13f23e53e6c509828,
    which vendors it). `admin` and `edit` hold it (pkg/bootstrappolicy/policy.go there: "admins can create
    routes with custom hosts"), `update` on it (ValidateHostUpdate: changing the host) neither does."""
    template = (ROOT / "charts" / "peagle-serving" / "templates" / "route.yaml").read_text()
    assert re.search(r"^spec:\n(?:.*\n)*?  host: ", template, re.M), "the chart no longer sets spec.host?"
    role = grants(objs[("Role", "peagle-pipeline-runner")]["rules"])
    custom_host = {t for t in role if t[:2] == ("route.openshift.io", "routes/custom-host")}
    assert custom_host == {("route.openshift.io", "routes/custom-host", "create")}
    assert custom_host <= project_admin
    assert ("route.openshift.io", "routes/custom-host", "update") not in project_admin


def test_the_overlays_hold_exactly_the_rest():
    """What the code needs beyond admin is in rbac-extra, one overlay per upstream role that carries it."""
    trainjob = kustomize_build(MANIFESTS / "rbac-extra" / "trainjob")
    monitoring = kustomize_build(MANIFESTS / "rbac-extra" / "monitoring")
    (tj_role,) = [o for o in trainjob if o["kind"] == "Role"]
    (mon_role,) = [o for o in monitoring if o["kind"] == "Role"]
    assert grants(tj_role["rules"]) == ({("trainer.kubeflow.org", "trainjobs", v) for v in ("create", "get", "patch",
                                                                                          "delete")}
                                        | {("", "configmaps", v) for v in ("create", "get", "patch")})  # verdicts
    assert grants(mon_role["rules"]) == {("monitoring.coreos.com", r, v) for r in ("servicemonitors", "podmonitors")
                                         for v in ("create", "get", "patch")}
    for objs, role in ((trainjob, tj_role), (monitoring, mon_role)):
        (binding,) = [o for o in objs if o["kind"] == "RoleBinding"]
        assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                      "name": role["metadata"]["name"]}
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": RUNNER_SA, "namespace": "peagle"}]
    readme = (MANIFESTS / "README.md").read_text()
    assert "`rbac-extra/trainjob/`" in readme and "`training-edit`" in readme
    assert "`rbac-extra/monitoring/`" in readme and "`monitoring-edit`" in readme and "a cluster admin" in readme
    top = yaml.safe_load((MANIFESTS / "kustomization.yaml").read_text())
    assert "rbac-extra" not in " ".join(top["resources"])  # optional: never applied by `apply -k manifests/`


def test_the_trainjob_overlay_grants_what_the_launcher_calls():
    """rbac-extra/trainjob: the verbs of the launcher's TrainJob calls (CustomObjectsApi) and of its verdict
    ConfigMap calls (CoreV1Api), and no more."""
    verb_of = {"create": "create", "get": "get", "read": "get", "patch": "patch", "delete": "delete"}
    code = (ROOT / "src/peagle/pipeline/trainjob.py").read_text()
    used = {("trainer.kubeflow.org", "trainjobs", verb_of[m])
            for m in re.findall(r"\b(create|get|patch|delete)_namespaced_custom_object\b", code)}
    code = (ROOT / "src/peagle/pipeline/trainjob_verdict.py").read_text()
    used |= {("", "configmaps", verb_of[m]) for m in re.findall(r"\b(create|read|patch)_namespaced_config_map\b", code)}
    assert grants(role_of(MANIFESTS / "rbac-extra" / "trainjob")["rules"]) == used
    assert ("trainer.kubeflow.org", "trainjobs", "delete") in used


def test_a_project_admin_may_apply_the_rollout_overlay_and_the_rest_is_apart(project_admin):
    """Kubernetes creates a Role only for someone who holds every rule of it (or `escalate`, which `admin`
    lacks): kubernetes/kubernetes pkg/registry/rbac/role/policybased/storage.go, Create ->
    ConfirmNoEscalation over the whole Role. So rbac-extra/rollout, which a project admin applies, must lie
    within `admin`, and what `admin` lacks sits in overlays of its own, each applied by its holder:
    HTTPRoutes (routing httproute) and delete on the canary's monitors (metrics.monitor.enabled)."""
    extra = MANIFESTS / "rbac-extra"
    rollout = grants(role_of(extra / "rollout")["rules"])
    assert rollout <= project_admin, sorted(rollout - project_admin)
    assert {("", "serviceaccounts", "delete"), ("", "configmaps", "delete")} <= rollout
    httproutes = grants(role_of(extra / "rollout-httproute")["rules"])
    assert httproutes == {("gateway.networking.k8s.io", "httproutes", v) for v in ("create", "get", "patch")}
    monitors = grants(role_of(extra / "rollout-monitoring")["rules"])
    assert monitors == {("monitoring.coreos.com", r, "delete") for r in ("servicemonitors", "podmonitors")}
    assert not (httproutes | monitors) & project_admin
    for overlay in ROLLOUT_OVERLAYS:
        objs = kustomize_build(extra / overlay)
        (role,) = [o for o in objs if o["kind"] == "Role"]
        (binding,) = [o for o in objs if o["kind"] == "RoleBinding"]
        assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                      "name": role["metadata"]["name"]}
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": RUNNER_SA, "namespace": "peagle"}]
        assert f"`rbac-extra/{overlay}/`" in (MANIFESTS / "README.md").read_text(), overlay


def test_the_rollout_role_printed_in_the_traffic_docs_is_the_overlays():
    """docs/traffic.md ("What a cluster admin must enable") prints the rollout's Roles: each is the Role of a
    rollout overlay (same name, same rules), and every rollout overlay is printed."""
    text = (ROOT / "docs" / "traffic.md").read_text()
    section = text.split("## What a cluster admin must enable", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"^```yaml\n(.*?)^```", section, re.M | re.S)
    printed = [d for block in blocks for d in yaml.safe_load_all(block) if d and d.get("kind") == "Role"]
    overlays = {role["metadata"]["name"]: role for role in
                (role_of(MANIFESTS / "rbac-extra" / overlay) for overlay in ROLLOUT_OVERLAYS)}
    assert sorted(d["metadata"]["name"] for d in printed) == sorted(overlays)
    for doc in printed:
        assert doc["rules"] == overlays[doc["metadata"]["name"]]["rules"], doc["metadata"]["name"]
    for overlay in ROLLOUT_OVERLAYS:
        assert f"manifests/rbac-extra/{overlay}" in section, overlay


def copy_manifests(tmp_path, namespace: str):
    """The manifests with every `namespace:` setting (and admin/project.yaml) changed, as a user would."""
    dst = tmp_path / "manifests"
    shutil.copytree(MANIFESTS, dst)
    for k in dst.rglob("kustomization.yaml"):
        text = k.read_text()
        if "\nnamespace: peagle\n" in text:
            k.write_text(text.replace("\nnamespace: peagle\n", f"\nnamespace: {namespace}\n"))
    project = dst / "admin" / "project.yaml"
    project.write_text(project.read_text().replace("namespace: peagle", f"namespace: {namespace}"))
    return dst


def test_binding_subjects_follow_the_namespace_set_in_one_place(tmp_path):
    for f in MANIFESTS.rglob("*binding.yaml"):  # nothing spelt out in the bindings themselves
        for doc in yaml.safe_load_all(f.read_text()):
            assert all("namespace" not in s for s in doc["subjects"]), f
    copied = copy_manifests(tmp_path, "team-a")
    for d in ("", *(f"rbac-extra/{overlay}" for overlay in EXTRA_OVERLAYS), "admin"):
        objs = kustomize_build(copied / d)
        bindings = [o for o in objs if o["kind"] in ("RoleBinding", "ClusterRoleBinding")]
        assert bindings, d
        for b in bindings:
            assert b["subjects"] == [{"kind": "ServiceAccount", "name": RUNNER_SA, "namespace": "team-a"}], (d, b)
            if b["kind"] == "RoleBinding":
                assert b["metadata"]["namespace"] == "team-a"
            else:  # one per project: its name carries the project too
                assert b["metadata"]["name"] == "peagle-clustertrainingruntime-reader-team-a"
        assert "ConfigMap" not in {o["kind"] for o in objs}  # admin/project.yaml is local-config


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl not installed (optional cross-check)")
def test_real_kustomize_fills_the_subjects_too(tmp_path):
    copied = copy_manifests(tmp_path, "team-b")
    for d in ("", *(f"rbac-extra/{overlay}" for overlay in EXTRA_OVERLAYS), "admin"):
        r = subprocess.run(["kubectl", "kustomize", str(copied / d)], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        ref = sorted(yaml.safe_load_all(r.stdout), key=lambda o: (o["kind"], o["metadata"]["name"]))
        assert ref == sorted(kustomize_build(copied / d), key=lambda o: (o["kind"], o["metadata"]["name"]))
        for b in (o for o in ref if o["kind"].endswith("RoleBinding")):
            assert b["subjects"][0]["namespace"] == "team-b"


def test_data_connection_template_carries_kserve_s3_annotations():
    (secret,) = kustomize_build(MANIFESTS / "data-connection")
    ann = secret["metadata"]["annotations"]
    endpoint = secret["stringData"]["AWS_S3_ENDPOINT"]
    assert ann["serving.kserve.io/s3-endpoint"] == endpoint.split("://", 1)[1]
    assert ann["serving.kserve.io/s3-usehttps"] == ("1" if endpoint.startswith("https://") else "0")
    assert ann["serving.kserve.io/s3-region"] == secret["stringData"]["AWS_DEFAULT_REGION"]
