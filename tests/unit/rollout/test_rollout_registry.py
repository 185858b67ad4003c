"""Promotion records and their registration in the Model Registry.

The registry is ``tests/support/model_registry_standin.py``: a STAND-IN HTTP server of the Kubeflow Model
Registry REST API (v1alpha3), in process -- no real registry runs here. The client talks HTTP to it.
"""
from __future__ import annotations

import json
from datetime import datetime, timezone

import pytest

from support.model_registry_standin import ModelRegistryStandIn
from peagle.rollout.decision import decide
from peagle.records.history import PROMOTION, LoopHistory
from peagle.records.lineage import Lineage
from support.loop_records import lineage_doc
from peagle.records.live import LiveComparison, VersionFigures
from peagle.rollout.objects import Candidate
from peagle.rollout.promotion import (PROMOTION_FORMAT, PromotionError, PromotionRecord, read_promotion,
                                      record_promotion, vllm_version)
from peagle.rollout.registry import ModelRegistryClient, ModelRegistryError, custom_properties, metadata_value
from peagle.rollout.settings import RegistrySettings, RolloutSettings
from peagle.storage import open_published, open_store
from peagle.stats import Estimate
from peagle.gate.report import DraftFigures, GateCheck, GateResult, PairedComparison, write_gate

TOKEN = "s3cr3t-bearer-token"
TARGET_FP = "ab" * 32
WHEN = datetime(2026, 12, 3, 15, 0, tzinfo=timezone.utc)


# -- fixtures: a real decision, gate report and lineage of the spec's shapes -----------------------------
def comparison(stable_fp: str, candidate_fp: str, al_stable: float, al_candidate: float) -> LiveComparison:
    def figures(role, fp, al):
        return VersionFigures(role, fp, 64, Estimate(al, (al - 0.05, al + 0.05)), Estimate(0.4, (0.35, 0.45)),
                              0.2, 500)
    diff = al_candidate - al_stable
    return LiveComparison(figures("stable", stable_fp, al_stable), figures("candidate", candidate_fp, al_candidate),
                          Estimate(diff, (diff - 0.04, diff + 0.04)), "2026-12-03T14:00:00.000000Z",
                          "2026-12-03T14:30:00.000000Z", 0.95, 1000)


def gate_report(tmp_path, name: str) -> str:
    al = lambda v: Estimate(v, (v - 0.1, v + 0.1))  # noqa: E731
    traffic = PairedComparison(48, 0, DraftFigures(al(1.30), al(0.3), 900), DraftFigures(al(1.45), al(0.4), 850),
                               al(0.15), al(0.1), 0.95, 1000)
    result = GateResult(True, (GateCheck("traffic_gain", True, 0.15, 0.0, "AL +0.150 >= +0.000"),),
                        {"path": "target", "fingerprint": TARGET_FP}, {"path": "serving"}, {"path": "candidate"}, 4,
                        {"traffic": traffic}, {"traffic": "traffic prompts"}, None, {})
    write_gate(result, tmp_path / name)
    return str(tmp_path / name / "gate.json")


def promotion_case(tmp_path, candidate_fp: str, stable_fp: str = "0123456789ab"):
    """A promote decision and its candidate (lineage and gate as a refresh writes them)."""
    report = gate_report(tmp_path, f"gate-{candidate_fp}")
    gate = {"passed": True, "reasons": [], "report": report}
    lineage = Lineage.from_dict(lineage_doc(
        base_draft={"uri": "s3://bucket/drafts/base", "fingerprint": stable_fp, "manifest_sha256": "f" * 64},
        outputs={"draft": f"s3://bucket/refresh/{candidate_fp}/draft",
                 "lineage": f"s3://bucket/refresh/{candidate_fp}/lineage.json"}), "lineage.json")
    candidate = Candidate(draft=f"s3://bucket/refresh/{candidate_fp}/draft", fingerprint=candidate_fp,
                                values={}, gate=gate, lineage=lineage)
    decision = decide(comparison(stable_fp, candidate_fp, 1.30, 1.42), RolloutSettings(min_requests=32),
                      window_over=False,
                      target_fingerprint=TARGET_FP, stable_draft="s3://bucket/drafts/base",
                      candidate_draft=candidate.draft, gate=gate, now=WHEN)
    assert decision.decision == "promote"
    return decision, candidate


@pytest.fixture
def standin():
    with ModelRegistryStandIn(token=TOKEN) as server:
        yield server


def settings_of(server: ModelRegistryStandIn, **kw) -> RegistrySettings:
    return RegistrySettings(url=server.url, token_env="TEST_REGISTRY_TOKEN", **kw)


ENV = {"TEST_REGISTRY_TOKEN": TOKEN}


def props(obj: dict) -> dict:
    """customProperties back to plain values."""
    out = {}
    for name, v in obj["customProperties"].items():
        key = next(k for k in v if k != "metadataType")
        out[name] = v[key]
    return out


# -- promotion -> registry ---------------------------------------------------------------------------
def test_each_promotion_is_a_new_version_of_one_registered_model_with_its_lineage(tmp_path, standin):
    history = LoopHistory(str(tmp_path / "history"))
    first = promotion_case(tmp_path, "111111111111")
    second = promotion_case(tmp_path, "222222222222", stable_fp="111111111111")
    records = [record_promotion(d, c, history=history, registry=settings_of(standin), env=ENV)
               for d, c in (first, second)]

    assert len(standin.registered_models) == 1
    model = next(iter(standin.registered_models.values()))
    assert model["name"] == f"peagle-draft-{TARGET_FP[:12]}"
    versions = standin.versions_of(model["name"])
    assert [v["name"] for v in versions] == ["111111111111", "222222222222"]
    p = props(versions[1])
    assert p["base_draft_uri"] == "s3://bucket/drafts/base" and p["base_draft_fingerprint"] == "111111111111"
    assert (p["traffic_since"], p["traffic_until"]) == ("2026-12-01T00:00:00.000000Z", "2026-12-02T23:59:59.000000Z")
    assert p["replay_fraction"] == 0.25
    assert p["gate_passed"] is True and p["gate_traffic_prompts"] == "48"
    assert p["gate_traffic_al_candidate"] == pytest.approx(1.45)
    assert p["gate_traffic_al_difference_low"] == pytest.approx(0.05)
    assert p["live_al_candidate"] == pytest.approx(1.42) and p["live_al_stable"] == pytest.approx(1.30)
    assert p["live_al_difference"] == pytest.approx(0.12) and p["live_requests_candidate"] == "64"
    assert p["decision_id"] == second[0].id and p["target_fingerprint"] == TARGET_FP
    assert p.get("vllm_version") == vllm_version()
    assert versions[1]["customProperties"]["replay_fraction"]["metadataType"] == "MetadataDoubleValue"
    assert versions[1]["customProperties"]["gate_passed"]["metadataType"] == "MetadataBoolValue"
    artifacts = standin.artifacts_of(versions[1]["id"])
    assert len(artifacts) == 1
    assert artifacts[0]["uri"] == "s3://bucket/refresh/222222222222/draft" and artifacts[0]["state"] == "LIVE"
    assert artifacts[0]["modelFormatName"] == "peagle-p-eagle-draft"

    assert records[1].registry.model_version_id == versions[1]["id"]
    assert records[1].registry.reused_version is False
    assert [d["decision_id"] for d in history.all(PROMOTION)] == [first[0].id, second[0].id]


def test_a_rerun_registers_nothing_twice(tmp_path, standin):
    history = LoopHistory(str(tmp_path / "history"))
    decision, candidate = promotion_case(tmp_path, "333333333333")
    settings = settings_of(standin, model_name="my-drafts")
    # the first run registered, then died before the history append: the rerun finds the version
    client = ModelRegistryClient.from_settings(settings, ENV)
    client.register(model_name="my-drafts", version_name="333333333333", uri=candidate.draft, properties={})
    again = record_promotion(decision, candidate, history=history, registry=settings, env=ENV)
    assert again.registry.reused_version is True
    once_more = record_promotion(decision, candidate, history=history, registry=settings, env=ENV)
    assert once_more == again  # the recorded one: nothing written
    assert len(standin.versions_of("my-drafts")) == 1
    assert len(standin.artifacts_of(standin.versions_of("my-drafts")[0]["id"])) == 1
    assert len(history.all(PROMOTION)) == 1


def test_registry_errors_name_the_endpoint_and_status_never_the_token(tmp_path, standin):
    history = LoopHistory(str(tmp_path / "history"))
    decision, candidate = promotion_case(tmp_path, "444444444444")
    standin.fail("POST", "/registered_models/", 500)
    with pytest.raises(ModelRegistryError) as err:
        record_promotion(decision, candidate, history=history, registry=settings_of(standin), env=ENV)
    message = str(err.value)
    assert "POST" in message and "/api/model_registry/v1alpha3/registered_models/" in message
    assert "HTTP 500" in message and TOKEN not in message
    # the promotion happened: it is recorded, without a registration (and says so); a rerun registers again
    assert "recorded in the loop history without a registration" in message
    assert [d["registry"] for d in history.all(PROMOTION)] == [None]

    with pytest.raises(ModelRegistryError) as err:  # wrong token: 401, and the token stays out of the message
        record_promotion(decision, candidate, history=history, registry=settings_of(standin),
                         env={"TEST_REGISTRY_TOKEN": "wrong-" + TOKEN})
    assert "HTTP 401" in str(err.value) and "wrong-" + TOKEN not in str(err.value)
    assert "(authorization sent: the variable TEST_REGISTRY_TOKEN)" in str(err.value)

    standin.fail("GET", "/registered_model", 503)  # a token in the endpoint shown (here: the query) is redacted
    client = ModelRegistryClient(standin.url, TOKEN)
    with pytest.raises(ModelRegistryError) as err:
        client.registered_model(f"name-{TOKEN}")
    assert TOKEN not in str(err.value) and "HTTP 503" in str(err.value)

    closed = ModelRegistryStandIn()
    with closed:
        url = closed.url
    with pytest.raises(ModelRegistryError, match="cannot reach the registry") as err:
        ModelRegistryClient(url, TOKEN, timeout_s=5).registered_model("m")
    assert TOKEN not in str(err.value)
    assert [d["registry"] for d in history.all(PROMOTION)] == [None]  # the failed reruns wrote nothing more


def test_a_registry_failure_after_the_promotion_still_records_it_and_a_rerun_registers_it(tmp_path, standin):
    """The stable serves the draft once record_promotion runs: a failing registry must not keep the promotion
    out of the loop history (the trigger compares live acceptance with it), and a rerun registers it."""
    history = LoopHistory(str(tmp_path / "history"))
    decision, candidate = promotion_case(tmp_path, "888888888888")
    out = str(tmp_path / "run")
    standin.fail("GET", "/registered_model", 503)
    with pytest.raises(ModelRegistryError, match="HTTP 503.*a rerun of the rollout registers it"):
        record_promotion(decision, candidate, history=history, registry=settings_of(standin), out=out, env=ENV)
    (first,) = history.all(PROMOTION)
    assert first["registry"] is None and first["decision_id"] == decision.id
    assert read_promotion(f"{out}/promotion").registry is None  # published as recorded: truthful
    assert history.latest(PROMOTION)["draft"]["fingerprint"] == "888888888888"  # what the next trigger reads
    assert standin.registered_models == {}

    again = record_promotion(decision, candidate, history=history, registry=settings_of(standin), out=out, env=ENV)
    assert again.registry is not None and again.registry.reused_version is False
    assert again.promoted_at == first["promoted_at"]  # the same promotion, now registered
    assert [d["registry"] is None for d in history.all(PROMOTION)] == [True, False]
    assert read_promotion(f"{out}/promotion") == again
    assert [v["name"] for v in standin.versions_of(f"peagle-draft-{TARGET_FP[:12]}")] == ["888888888888"]
    # registered now: a further rerun writes and registers nothing
    assert record_promotion(decision, candidate, history=history, registry=settings_of(standin), env=ENV) == again
    assert len(history.all(PROMOTION)) == 2 and len(standin.versions_of(f"peagle-draft-{TARGET_FP[:12]}")) == 1


def test_the_token_is_the_variable_else_the_service_account_token_else_none(tmp_path, standin):
    """As the Kubeflow Model Registry's Python client: without the variable (nothing sets it in a pipeline
    step's pod) the pod's ServiceAccount token is the bearer token; without either, no Authorization header."""
    sa_token = tmp_path / "serviceaccount" / "token"
    sa_token.parent.mkdir()
    sa_token.write_text(TOKEN + "\n")
    settings = settings_of(standin)
    from_env = ModelRegistryClient.from_settings(settings, ENV, service_account_token=tmp_path / "none")
    assert from_env.registered_model("m")["name"] == "m"
    from_file = ModelRegistryClient.from_settings(settings, {}, service_account_token=sa_token)
    assert from_file.registered_model("m")["name"] == "m"  # the stand-in answers 401 to any other token
    sa_token.write_text("other-service-account-token")  # the variable wins over the file
    assert ModelRegistryClient.from_settings(settings, ENV, service_account_token=sa_token).registered_model("m")

    with pytest.raises(ModelRegistryError, match=r"HTTP 401") as err:  # refused: says which token was sent
        ModelRegistryClient.from_settings(settings, {}, service_account_token=sa_token).registered_model("m")
    assert "ServiceAccount token" in str(err.value) and str(sa_token) in str(err.value)
    assert "other-service-account-token" not in str(err.value)
    with pytest.raises(ModelRegistryError, match=r"HTTP 401.*TEST_REGISTRY_TOKEN is not set and there is no "
                                                 r"ServiceAccount token at"):
        ModelRegistryClient.from_settings(settings, {}, service_account_token=tmp_path / "none").registered_model("m")

    open_registry = _Answer(200, b'{"id": "1", "name": "m"}', {"Content-Type": "application/json"})
    try:
        ModelRegistryClient.from_settings(settings.model_copy(update={"url": open_registry.url}), {},
                                          service_account_token=tmp_path / "none").registered_model("m")
        ModelRegistryClient.from_settings(settings.model_copy(update={"url": open_registry.url}), {},
                                          service_account_token=sa_token).registered_model("m")
    finally:
        open_registry.close()
    assert open_registry.authorization == [None, "Bearer other-service-account-token"]


def test_the_service_account_token_is_the_default_of_a_promotion(tmp_path, standin, monkeypatch):
    """record_promotion, as the pipeline's rollout step calls it (no variable set), registers with the
    ServiceAccount token."""
    from peagle.rollout import registry as registry_module

    sa_token = tmp_path / "token"
    sa_token.write_text(TOKEN)
    monkeypatch.setattr(registry_module, "SERVICE_ACCOUNT_TOKEN", str(sa_token))
    monkeypatch.delenv("TEST_REGISTRY_TOKEN", raising=False)
    history = LoopHistory(str(tmp_path / "history"))
    decision, candidate = promotion_case(tmp_path, "999999999999")
    record = record_promotion(decision, candidate, history=history, registry=settings_of(standin))
    assert record.registry is not None and [d["registry"] is None for d in history.all(PROMOTION)] == [False]


def test_an_unreadable_service_account_token_is_an_error_naming_the_file(tmp_path, standin):
    with pytest.raises(ModelRegistryError, match=rf"ServiceAccount token {tmp_path} cannot be read .*"
                                                 "TEST_REGISTRY_TOKEN"):
        ModelRegistryClient.from_settings(settings_of(standin), {}, service_account_token=tmp_path)


def test_custom_properties_follow_the_metadata_value_schema():
    assert custom_properties({"s": "x", "i": 7, "f": 0.5, "b": False, "none": None, "big": 12_345_678_901}) == {
        "s": {"metadataType": "MetadataStringValue", "string_value": "x"},
        "i": {"metadataType": "MetadataIntValue", "int_value": "7"},
        "f": {"metadataType": "MetadataDoubleValue", "double_value": 0.5},
        "b": {"metadataType": "MetadataBoolValue", "bool_value": False},
        "big": {"metadataType": "MetadataStringValue", "string_value": "12345678901"}}
    with pytest.raises(ValueError, match="'nan'"):
        metadata_value("nan", float("nan"))


# -- the record --------------------------------------------------------------------------------------
def test_record_round_trips_and_is_published_under_out(tmp_path):
    history = LoopHistory(str(tmp_path / "history"))
    decision, candidate = promotion_case(tmp_path, "555555555555")
    record = record_promotion(decision, candidate, history=history, registry=RegistrySettings(),
                              out=str(tmp_path / "run"))
    assert record.registry is None
    assert record.draft.model_dump() == {"uri": candidate.draft, "fingerprint": "555555555555"}
    assert record.base_draft.model_dump() == {"uri": "s3://bucket/drafts/base", "fingerprint": "0123456789ab"}
    assert record.lineage_uri == "s3://bucket/refresh/555555555555/lineage.json"
    assert record.live == decision.comparison and record.decision_id == decision.id
    assert record.gate.figures["traffic"].prompts == 48

    doc = json.loads(json.dumps(record.to_dict()))
    assert doc["format"] == PROMOTION_FORMAT
    assert PromotionRecord.from_dict(doc, "here") == record
    assert history.latest(PROMOTION) == doc

    published = open_published(open_store(str(tmp_path / "run" / "promotion")), "", deep=True)
    assert published.manifest.metadata == doc
    assert json.loads(published.get_bytes("promotion.json")) == doc
    assert read_promotion(str(tmp_path / "run" / "promotion")) == record


@pytest.mark.parametrize("change, field", [
    ({"extra": 1}, "extra"), ({"draft": {"uri": "x"}}, "draft"), ({"replay_fraction": 2.0}, "replay_fraction"),
    ({"live": {}}, "live"), ({"promoted_at": "yesterday"}, "promoted_at"), ({"format": "v0"}, "format"),
    ({"registry": {"url": "x"}}, "registry")])
def test_record_parsing_is_strict(tmp_path, change, field):
    decision, candidate = promotion_case(tmp_path, "666666666666")
    history = LoopHistory(str(tmp_path / "history"))
    doc = record_promotion(decision, candidate, history=history, registry=RegistrySettings()).to_dict()
    with pytest.raises(PromotionError, match=f"where: field '{field}'"):
        PromotionRecord.from_dict({**doc, **change}, "where")
    missing = dict(doc)
    del missing["gate"]
    with pytest.raises(PromotionError, match="field 'gate': missing"):
        PromotionRecord.from_dict(missing, "where")


def test_a_rollback_is_not_a_promotion(tmp_path):
    decision, candidate = promotion_case(tmp_path, "777777777777")
    rollback = type(decision)(**{**{k: v for k, v in decision.to_dict().items() if k != "format"},
                                 "decision": "rollback"})
    with pytest.raises(PromotionError, match="not 'promote'"):
        record_promotion(rollback, candidate, history=LoopHistory(str(tmp_path / "h")), registry=RegistrySettings())


def test_the_standin_refuses_bodies_the_api_schema_refuses(standin):
    """The stand-in is only worth testing against if it checks bodies as the real API's schema does."""
    import urllib.error
    import urllib.request

    model = ModelRegistryClient(standin.url, TOKEN).registered_model("m")
    path = f"{standin.url}/api/model_registry/v1alpha3/registered_models/{model['id']}/versions"
    rm = model["id"]
    bad = [({"registeredModelId": rm}, "name is required"),
           ({"name": "v", "registeredModelId": rm, "colour": "red"}, "unknown fields"),
           ({"name": "v", "registeredModelId": rm,
             "customProperties": {"n": {"metadataType": "MetadataIntValue", "int_value": 7}}}, "wrong type"),
           ({"name": "v", "registeredModelId": rm,
             "customProperties": {"n": {"metadataType": "MetadataNumber", "value": 7}}}, "not a MetadataValue"),
           ({"name": "v", "registeredModelId": rm, "state": "GONE"}, "is not one of")]
    for body, why in bad:
        request = urllib.request.Request(path, json.dumps(body).encode(), method="POST", headers={
            "Content-Type": "application/json", "Authorization": f"Bearer {TOKEN}"})
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(request, timeout=10)
        assert err.value.code == 400 and why in json.loads(err.value.read())["message"]
    assert standin.versions_of("m") == []


class _Answer:
    """A plain HTTP server on 127.0.0.1 that gives every request one canned answer and keeps the
    Authorization headers it was sent (a hostile or misconfigured registry; the stand-in's API is not
    the subject here)."""

    def __init__(self, status: int, body: bytes = b"", headers: dict | None = None):
        import http.server
        import threading

        seen = self.authorization = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802
                seen.append(self.headers.get("Authorization"))
                self.send_response(status)
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def test_a_token_echoed_deep_in_an_error_body_is_masked_before_the_message_is_cut():
    body = json.dumps({"message": "x" * 280 + f" your token {TOKEN} and Bearer other-{TOKEN[::-1]}"}).encode()
    server = _Answer(500, body, {"Content-Type": "application/json"})
    try:
        with pytest.raises(ModelRegistryError) as err:
            ModelRegistryClient(server.url, TOKEN, timeout_s=5).registered_model("m")
    finally:
        server.close()
    message = str(err.value)
    assert "HTTP 500" in message and TOKEN[:4] not in message.replace("***", ""), message


def test_a_redirect_to_another_origin_never_receives_the_token():
    elsewhere = _Answer(200, b"{}", {"Content-Type": "application/json"})
    registry = _Answer(302, b"", {"Location": elsewhere.url + "/api/model_registry/v1alpha3/registered_model"})
    try:
        with pytest.raises(ModelRegistryError, match="redirect .* not followed") as err:
            ModelRegistryClient(registry.url, TOKEN, timeout_s=5).registered_model("m")
    finally:
        registry.close()
        elsewhere.close()
    assert registry.authorization == [f"Bearer {TOKEN}"] and elsewhere.authorization == []
    assert TOKEN not in str(err.value)


def test_an_endless_error_body_is_read_only_as_far_as_the_message_needs():
    """A registry that answers 500 with a body of 64 MiB (as good as endless): the client reads its start,
    not all of it (a body without end would fill the memory)."""
    import socket
    import threading

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    sent = []

    def answer() -> None:
        conn, _ = server.accept()
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 16)
        n = 0
        try:
            conn.recv(65536)
            conn.sendall(b"HTTP/1.1 500 Oops\r\nContent-Type: text/plain\r\nConnection: close\r\n\r\n")
            while n < 64 << 20:
                n += conn.send(b"z" * (1 << 16))
        except OSError:  # the client closed the connection
            pass
        finally:
            sent.append(n)
            conn.close()

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    try:
        with pytest.raises(ModelRegistryError, match="HTTP 500 Oops: zzz"):
            ModelRegistryClient(f"http://127.0.0.1:{server.getsockname()[1]}", TOKEN, timeout_s=5).registered_model("m")
        thread.join(10)
    finally:
        server.close()
    assert sent and sent[0] < 16 << 20, sent
