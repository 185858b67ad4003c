"""The cluster profile's side of the refresh pipeline (issue #39): the trigger and the rollout steps have small
resources of their own and no scratch volume; the run's rollout settings must fit the rollout step's deadline,
refused at submission and in the trigger step, before any GPU step; a hardware profile needs its namespace."""
# No `from __future__ import annotations`: KFP reads the components' annotations as types.

import sys
from types import SimpleNamespace

import pytest
import yaml

from support.paths import REPO
from support.refresh_pipeline import trigger_arguments
from peagle.config import ConfigError
from peagle.pipeline.profile import (ROLLOUT_MARGIN_S, ClusterProfile, check_rollout_deadline, load_profile,
                                     rollout_deadline_needed)
from peagle.pipeline.refresh_params import (ROLLOUT_DEADLINE_ENV, RefreshParams, check_refresh_arguments,
                                            resolve_refresh)

COMPILED = REPO / "pipelines" / "compiled" / "peagle-refresh.yaml"
DEFAULT_PROFILE = REPO / "pipelines" / "profiles" / "default.yaml"
HW_NAME = "opendatahub.io/hardware-profile-name"
HW_NAMESPACE = "opendatahub.io/hardware-profile-namespace"
if str(REPO) not in sys.path:  # components/ live at the project root
    sys.path.insert(0, str(REPO))


@pytest.fixture(scope="module")
def compiled() -> tuple[dict, dict]:
    """(container executors, Kubernetes executor configs) of the committed refresh pipeline."""
    spec, platform = list(yaml.safe_load_all(COMPILED.read_text()))
    return (spec["deploymentSpec"]["executors"],
            platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"])


# ---- the trigger and the rollout: small steps of their own ---------------------------------------------


@pytest.mark.parametrize("profile", [ClusterProfile(), load_profile(DEFAULT_PROFILE)], ids=["defaults", "default.yaml"])
def test_the_trigger_and_the_rollout_are_small_cpu_steps_without_scratch(profile):
    for name in ("trigger", "rollout"):
        step = profile.step(name)
        assert step.cpu and step.cpu_limit and step.memory, name
        assert step.gpus == 0 and step.scratch is False, name
    assert profile.step("rollout").timeout_s == 12 * 3600


def test_the_compiled_trigger_and_rollout_take_their_own_steps(compiled):
    containers, k8s = compiled
    trigger, rollout = containers["exec-refresh-trigger"]["container"], containers["exec-refresh-rollout"]["container"]
    assert trigger["resources"]["resourceMemoryLimit"] == "4Gi" and trigger["resources"]["resourceCpuRequest"] == "1"
    assert rollout["resources"]["resourceMemoryLimit"] == "2Gi" and rollout["resources"]["resourceCpuRequest"] == "500m"
    for name in ("exec-refresh-trigger", "exec-refresh-rollout"):
        assert "genericEphemeralVolume" not in k8s[name], name  # no 200Gi scratch claim per scheduled run
        env = {e["name"] for e in containers[name]["container"].get("env", [])}
        assert not {"PEAGLE_CACHE", "TMPDIR"} & env, name
    assert int(k8s["exec-refresh-trigger"]["activeDeadlineSeconds"]) == 2 * 3600
    # the trigger knows the rollout step's deadline, to check the run's rollout settings against it
    env = {e["name"]: e["value"] for e in trigger["env"]}
    assert env[ROLLOUT_DEADLINE_ENV] == k8s["exec-refresh-rollout"]["activeDeadlineSeconds"] == str(12 * 3600)


# ---- the rollout settings fit the rollout step's deadline -----------------------------------------------


def test_the_deadline_holds_the_window_its_last_poll_two_ready_waits_and_a_margin():
    assert rollout_deadline_needed(3600, 1800, 30) == 3600 + 30 + 2 * 1800 + ROLLOUT_MARGIN_S
    check_rollout_deadline(3600, 1800, 30, 12 * 3600)  # the defaults fit the default deadline
    with pytest.raises(ConfigError) as err:
        check_rollout_deadline(40000, 1800, 30, 12 * 3600)
    message = str(err.value)
    assert "rollout.window_s=40000" in message and "steps.rollout.timeout_s=43200" in message
    assert "rollout.ready_timeout_s=1800" in message and f"at least {40000 + 30 + 3600 + ROLLOUT_MARGIN_S}" in message


def params(**kw) -> RefreshParams:
    return RefreshParams(target="s3:///r/models/target", serving_draft="s3:///r/models/draft", traffic="s3:///t", **kw)


def test_resolve_refresh_refuses_a_window_the_deadline_cannot_hold(monkeypatch):
    monkeypatch.delenv(ROLLOUT_DEADLINE_ENV, raising=False)
    long_window = params(rollout_routing="route", rollout_window_s=40000.0)
    with pytest.raises(ConfigError, match=r"rollout.window_s=40000 .*steps.rollout.timeout_s=43200"):
        resolve_refresh(long_window, "", "/r", rollout_deadline_s=12 * 3600)
    with pytest.raises(ConfigError, match=r"rollout.ready_timeout_s=20000"):  # from the config too
        resolve_refresh(params(rollout_routing="route"), "rollout: {ready_timeout_s: 20000}\n", "/r",
                        rollout_deadline_s=12 * 3600)
    assert resolve_refresh(long_window, "", "/r", rollout_deadline_s=24 * 3600).config.rollout.window_s == 40000
    assert resolve_refresh(long_window, "", "/r").config.rollout.window_s == 40000  # deadline not known here
    # no rollout (routing none): the window is not used
    assert resolve_refresh(params(rollout_window_s=40000.0), "", "/r", rollout_deadline_s=12 * 3600)

    monkeypatch.setenv(ROLLOUT_DEADLINE_ENV, str(12 * 3600))  # what the compiled pipeline sets on the trigger
    with pytest.raises(ConfigError, match="steps.rollout.timeout_s=43200"):
        resolve_refresh(long_window, "", "/r")
    monkeypatch.setenv(ROLLOUT_DEADLINE_ENV, "12h")
    with pytest.raises(ConfigError, match=f"{ROLLOUT_DEADLINE_ENV}='12h' is not whole seconds"):
        resolve_refresh(long_window, "", "/r")


def test_the_trigger_step_refuses_it_before_anything_else(tmp_path, monkeypatch):
    import components.refresh as comp

    monkeypatch.setenv(ROLLOUT_DEADLINE_ENV, str(12 * 3600))
    args = trigger_arguments(output_root=str(tmp_path / "out"), rollout_routing="route", rollout_window_s=40000.0)
    with pytest.raises(ConfigError, match="rollout.window_s=40000"):
        comp.refresh_trigger(**args, metrics=None, trigger=None)
    assert not (tmp_path / "out").exists()  # nothing written: no run.json, no GPU step after it


def test_submission_checks_the_window_against_the_profiles_deadline(tmp_path):
    from peagle.pipeline.__main__ import _arguments

    def ns(*extra, profile="default", package=None):
        return SimpleNamespace(param=["target=s3:///r/models/target", "serving_draft=s3:///r/models/draft",
                                      "traffic=s3:///traffic", "rollout_routing=route", *extra],
                               config=None, package=package, profile=profile)

    with pytest.raises(ConfigError, match="rollout.window_s=40000 .*steps.rollout.timeout_s=43200"):
        _arguments(ns("rollout_window_s=40000"), "refresh")
    longer = tmp_path / "long.yaml"
    longer.write_text("name: long\nsteps:\n  rollout: {timeout_s: 86400}\n")
    assert _arguments(ns("rollout_window_s=40000", profile=str(longer)), "refresh")["rollout_window_s"] == 40000
    shorter = tmp_path / "short.yaml"
    shorter.write_text("name: short\nsteps:\n  rollout: {timeout_s: 7200}\n")
    with pytest.raises(ConfigError, match="steps.rollout.timeout_s=7200"):  # even the default window
        _arguments(ns(profile=str(shorter)), "refresh")
    assert check_refresh_arguments({"target": "s3:///t", "serving_draft": "s3:///d", "traffic": "s3:///x",
                                    "rollout_routing": "route", "rollout_window_s": 40000.0})  # no profile known


# ---- a hardware profile is named with its namespace --------------------------------------------------


def test_a_hardware_profile_named_without_its_namespace_is_refused(tmp_path):
    prof = tmp_path / "profile.yaml"
    prof.write_text(f"name: q\naccelerator:\n  annotations:\n    {HW_NAME}: nvidia-h100\n")
    with pytest.raises(ConfigError) as err:
        load_profile(prof)
    message = str(err.value)
    assert f"accelerator.annotations: {HW_NAME} 'nvidia-h100' needs {HW_NAMESPACE} (" in message
    assert "refuses the InferenceService at admission" in message and message.endswith(
        "its namespace, e.g. redhat-ods-applications (OpenShift AI) or opendatahub (Open Data Hub)")
    prof.write_text(f"name: q\naccelerator:\n  annotations:\n    {HW_NAME}: nvidia-h100\n"
                    f"    {HW_NAMESPACE}: redhat-ods-applications\n")
    assert load_profile(prof).accelerator.hardware_profile() == {
        "kind": "hardwareProfile", "name": "nvidia-h100", "namespace": "redhat-ods-applications"}
    prof.write_text("name: q\naccelerator:\n  annotations:\n    opendatahub.io/accelerator-name: gpu\n")
    assert load_profile(prof).accelerator.hardware_profile()["kind"] == "acceleratorProfile"  # 2.x: no namespace


def test_the_default_profile_shows_a_hardware_profile_with_its_namespace():
    text = DEFAULT_PROFILE.read_text()
    assert f"{HW_NAME}: <name>" in text and f"{HW_NAMESPACE}: redhat-ods-applications" in text


# ---- promotion by swap (issue #41): the rollout step gets the swap endpoint's token -----------------------


def test_a_profile_serving_the_swap_endpoint_gives_the_rollout_step_its_token(tmp_path):
    from peagle.pipeline.build import compile_pipeline

    assert ClusterProfile().swap_token_secret() is None
    prof = tmp_path / "swap.yaml"
    prof.write_text("name: swap\nserving:\n  values:\n    swap:\n      enabled: true\n"
                    "      tokenSecret: {name: peagle-swap, key: bearer}\n")
    assert load_profile(prof).swap_token_secret() == ("peagle-swap", "bearer")
    _, platform = list(yaml.safe_load_all(compile_pipeline(prof, tmp_path / "p.yaml", pipeline="refresh").read_text()))
    k8s = platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    assert k8s["exec-refresh-rollout"]["secretAsEnv"] == [{"keyToEnv": [{"envVar": "PEAGLE_SWAP_TOKEN",
                                                                         "secretKey": "bearer"}],
                                                           "optional": False, "secretName": "peagle-swap",
                                                           "secretNameParameter": {"runtimeValue": {"constant": "peagle-swap"}}}]
    assert not any("secretAsEnv" in cfg for name, cfg in k8s.items() if name != "exec-refresh-rollout")
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: bad\nserving:\n  values:\n    swap: {enabled: true}\n")
    with pytest.raises(ConfigError, match="swap.tokenSecret.name is required"):
        load_profile(bad).swap_token_secret()
