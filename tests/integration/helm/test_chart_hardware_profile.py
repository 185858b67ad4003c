"""The serving chart's ``kserve.hardwareProfile`` (OpenShift AI 3.x): a hardware profile is named with its
namespace. odh-model-controller looks a profile named alone up in the InferenceService's own namespace (the
project's) and refuses the object at admission, while a global profile lives in the dashboard's namespace, so
the chart refuses the name alone when it renders (issue #39)."""
from __future__ import annotations

import copy

import pytest
import yaml

from support.k8s_schemas import ROOT
from support.kserve_admission import Refused, odh_hardware_profile_webhook
from peagle.deploy import RenderError, render

CHART = ROOT / "charts" / "peagle-serving"
HW_NAME = "opendatahub.io/hardware-profile-name"
HW_NAMESPACE = "opendatahub.io/hardware-profile-namespace"


def values(**hardware_profile) -> dict:
    base = yaml.safe_load((CHART / "ci" / "kserve-data-connection-values.yaml").read_text())
    kserve = {**base.get("kserve", {}), "hardwareProfile": hardware_profile}
    return {**base, "kserve": kserve}


def test_a_hardware_profile_without_its_namespace_is_refused():
    with pytest.raises(RenderError, match=r"kserve.hardwareProfile.namespace is required with "
                                          r"kserve.hardwareProfile.kind=hardwareProfile.*admission.*"
                                          r"redhat-ods-applications on OpenShift AI, opendatahub on Open Data Hub"):
        render(values(kind="hardwareProfile", name="nvidia-h100"), "x", "ml", CHART)
    with pytest.raises(RenderError, match="kserve.hardwareProfile.namespace is required"):
        render(values(kind="hardwareProfile", name="nvidia-h100", namespace=""), "x", "ml", CHART)
    objs = {o["kind"]: o for o in render(values(kind="hardwareProfile", name="nvidia-h100",
                                                namespace="redhat-ods-applications"), "x", "ml", CHART)}
    ann = objs["InferenceService"]["metadata"]["annotations"]
    assert (ann[HW_NAME], ann[HW_NAMESPACE]) == ("nvidia-h100", "redhat-ods-applications")
    # a 2.x accelerator profile has no namespace
    objs = {o["kind"]: o for o in render(values(kind="acceleratorProfile", name="gpu"), "x", "ml", CHART)}
    assert objs["InferenceService"]["metadata"]["annotations"]["opendatahub.io/accelerator-name"] == "gpu"


def test_odh_model_controller_refuses_the_name_alone_and_admits_the_rendered_profile():
    """Through the stand-in of odh-model-controller's webhook (support.kserve_admission): what the chart renders
    is admitted; the same object with the namespace annotation dropped -- what the chart rendered before --
    is refused, the profile looked up in the project."""
    objs = {o["kind"]: o for o in render(values(kind="hardwareProfile", name="nvidia-gpu",
                                                namespace="redhat-ods-applications"), "x", "ml", CHART)}
    isvc = objs["InferenceService"]
    odh_hardware_profile_webhook(None, isvc)
    alone = copy.deepcopy(isvc)
    del alone["metadata"]["annotations"][HW_NAMESPACE]
    with pytest.raises(Refused, match="hardware profile 'nvidia-gpu' not found in namespace 'ml'"):
        odh_hardware_profile_webhook(None, alone)
