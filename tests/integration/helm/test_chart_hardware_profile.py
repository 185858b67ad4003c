"""The serving chart's ``kserve.hardwareProfile`` (OpenShift AI 3.x): a hardware profile is named with its
namespace. odh-model-controller looks a profile named alone up in the InferenceService's own namespace (the
project's) and refuses the object at admission, while a global profile lives in the dashboard's namespace, so
the chart refuses the name alone when it renders (issue #39)."""
from __future__ import annotations

import pytest
import yaml

from support.k8s_schemas import ROOT
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
