"""The serving chart's ``storage.uris.connection``: a model served from two URIs (KServe ``storageUris``, how the
refresh pipeline serves a candidate beside its run's target) is fetched with a data connection's credentials.
OpenShift AI: odh-model-controller gives the storage initializer a connection's credentials only for an
InferenceService annotated ``opendatahub.io/connections`` (issue #39's review of odh-model-controller), so the
chart names it there; upstream KServe reads S3 credentials from the predictor's ServiceAccount's secrets."""
from __future__ import annotations

import yaml

from support.k8s_schemas import ROOT, validate
from peagle.deploy import render

CHART = ROOT / "charts" / "peagle-serving"
CONNECTIONS = "opendatahub.io/connections"


def values(openshift_ai: bool = True, **uris) -> dict:
    base = yaml.safe_load((CHART / "ci" / "kserve-storage-uris-values.yaml").read_text())
    storage = {**base["storage"], "uris": {**base["storage"]["uris"], **uris}}
    return {**base, "storage": storage, "kserve": {**base.get("kserve", {}), "openshiftAI": openshift_ai}}


def by_kind(objs: list[dict]) -> dict[str, dict]:
    return {o["kind"]: o for o in objs}


def test_the_connection_fetches_both_uris_on_openshift_ai_and_upstream():
    objs = by_kind(render(values(connection="models", serviceAccountName=""), "x", "ml", CHART))
    isvc = objs["InferenceService"]
    assert isvc["metadata"]["annotations"][CONNECTIONS] == "models"
    assert "ServiceAccount" not in objs and "serviceAccountName" not in isvc["spec"]["predictor"]
    for o in objs.values():
        validate(o)

    upstream = by_kind(render(values(False, connection="models", serviceAccountName=""), "x", "ml", CHART))
    assert CONNECTIONS not in upstream["InferenceService"]["metadata"]["annotations"]
    assert upstream["ServiceAccount"]["metadata"]["name"] == "x-s3"
    assert upstream["ServiceAccount"]["secrets"] == [{"name": "models"}]
    assert upstream["InferenceService"]["spec"]["predictor"]["serviceAccountName"] == "x-s3"

    # a ServiceAccount of the user's wins upstream; no connection: neither annotation nor ServiceAccount
    own = by_kind(render(values(False, connection="models", serviceAccountName="mine"), "x", "ml", CHART))
    assert "ServiceAccount" not in own and own["InferenceService"]["spec"]["predictor"]["serviceAccountName"] == "mine"
    bare = by_kind(render(values(connection="", serviceAccountName=""), "x", "ml", CHART))
    assert CONNECTIONS not in bare["InferenceService"]["metadata"]["annotations"]
