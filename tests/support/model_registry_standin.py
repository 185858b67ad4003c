"""A STAND-IN for the OpenShift AI (Kubeflow) Model Registry REST server: in-process, in memory, for tests.

No Model Registry server runs here (it needs its database and a cluster), so the tests of
:mod:`peagle.rollout.registry` talk HTTP to this one instead. It is not the real server. It mirrors
the part of ``api/openapi/model-registry.yaml`` (kubeflow/model-registry, API ``v1alpha3``) that the
client uses, checking request bodies the way that schema does:

* ``GET  /api/model_registry/v1alpha3/registered_model?name=`` -- findRegisteredModel: 200, or 404;
* ``POST /api/model_registry/v1alpha3/registered_models`` -- createRegisteredModel (RegisteredModelCreate:
  ``name`` required, ``state`` LIVE|ARCHIVED), 201; 409 when the name is taken;
* ``GET  /api/model_registry/v1alpha3/registered_models/{id}/versions`` -- ModelVersionList;
* ``POST /api/model_registry/v1alpha3/registered_models/{id}/versions`` -- createRegisteredModelVersion
  (ModelVersion: ``name`` and ``registeredModelId`` required, ids match ``^[1-9][0-9]{0,8}$``), 201;
  409 when the registered model has a version of that name;
* ``GET  /api/model_registry/v1alpha3/model_version?name=&parentResourceId=`` -- findModelVersion;
* ``GET|POST /api/model_registry/v1alpha3/model_versions/{id}/artifacts`` -- ArtifactList, and
  upsertModelVersionArtifact (Artifact with the ``artifactType`` discriminator ``model-artifact``;
  ``state`` one of ArtifactState), 201.

``customProperties`` values are checked as ``MetadataValue``: a known ``metadataType`` with exactly its
required field (``string_value`` str, ``int_value`` an int32 string, ``double_value`` a number,
``bool_value`` a bool). Unknown body fields are refused (400), as a strict decoder of that schema
would. Objects get string ids, ``createTimeSinceEpoch``/``lastUpdateTimeSinceEpoch`` and the schema's
default ``state``. With ``token`` set, a request without ``Authorization: Bearer <token>`` gets 401.
Errors have the API's ``Error`` body ``{code, message}``. ``fail(method, path, status)`` makes the next
matching request fail, for error paths.
"""
from __future__ import annotations

import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

PREFIX = "/api/model_registry/v1alpha3"
ID = re.compile(r"^[1-9][0-9]{0,8}$")
INT32 = re.compile(r"^-?([1-9][0-9]{0,8}|0)$")
METADATA_FIELDS = {"MetadataStringValue": ("string_value", str), "MetadataIntValue": ("int_value", str),
                   "MetadataDoubleValue": ("double_value", (int, float)), "MetadataBoolValue": ("bool_value", bool),
                   "MetadataStructValue": ("struct_value", str)}
BASE_CREATE = {"customProperties", "description", "externalId", "name"}
BASE_MODEL = {"readme", "maturity", "language", "tasks", "provider", "logo", "license", "licenseLink", "libraryName"}
REGISTERED_MODEL_FIELDS = BASE_CREATE | BASE_MODEL | {"owner", "state"}
MODEL_VERSION_FIELDS = BASE_CREATE | {"state", "author", "registeredModelId"}
MODEL_ARTIFACT_FIELDS = BASE_CREATE | {"artifactType", "modelFormatName", "storageKey", "storagePath",
                                       "modelFormatVersion", "serviceAccountName", "modelSourceKind",
                                       "modelSourceClass", "modelSourceGroup", "modelSourceId", "modelSourceName",
                                       "uri", "state", "experimentId", "experimentRunId"}
ARTIFACT_STATES = {"UNKNOWN", "PENDING", "LIVE", "MARKED_FOR_DELETION", "DELETED", "ABANDONED", "REFERENCE"}
LIVE_OR_ARCHIVED = {"LIVE", "ARCHIVED"}


class ApiError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class ModelRegistryStandIn:
    """The stand-in server (see the module docstring). Use as a context manager; ``url`` is its base."""

    def __init__(self, token: str | None = None):
        self.token = token
        self.registered_models: dict[str, dict[str, Any]] = {}
        self.model_versions: dict[str, dict[str, Any]] = {}
        self.artifacts: dict[str, dict[str, Any]] = {}
        self.artifact_version: dict[str, str] = {}  # artifact id -> its model version id
        self.requests: list[tuple[str, str]] = []  # (method, path with query)
        self._failures: list[tuple[str, str, int]] = []
        self._next_id = 1
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> "ModelRegistryStandIn":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)

    def fail(self, method: str, path: str, status: int) -> None:
        """The next ``method`` request whose path (without the API prefix) starts with ``path`` gets ``status``."""
        self._failures.append((method, path, status))

    def versions_of(self, model_name: str) -> list[dict[str, Any]]:
        model = next(m for m in self.registered_models.values() if m["name"] == model_name)
        return [v for v in self.model_versions.values() if v["registeredModelId"] == model["id"]]

    def artifacts_of(self, version_id: str) -> list[dict[str, Any]]:
        return [a for i, a in self.artifacts.items() if self.artifact_version[i] == version_id]

    # -- the API ----------------------------------------------------------------------------------
    def handle(self, method: str, path: str, query: dict[str, str], body: Any) -> tuple[int, Any]:
        for failure in self._failures:
            if failure[0] == method and path.startswith(failure[1]):
                self._failures.remove(failure)
                raise ApiError(failure[2], f"injected failure of {method} {path}")
        parts = path.strip("/").split("/")
        if method == "GET" and parts == ["registered_model"]:
            return 200, self._find(self.registered_models, query.get("name"), None)
        if method == "POST" and parts == ["registered_models"]:
            return 201, self._create_registered_model(body)
        if len(parts) == 3 and parts[0] == "registered_models" and parts[2] == "versions":
            model = self._get(self.registered_models, parts[1], "registered model")
            if method == "GET":
                return 200, _listing([v for v in self.model_versions.values() if v["registeredModelId"] == model["id"]])
            if method == "POST":
                return 201, self._create_model_version(model, body)
        if method == "GET" and parts == ["model_version"]:
            return 200, self._find(self.model_versions, query.get("name"), query.get("parentResourceId"))
        if len(parts) == 3 and parts[0] == "model_versions" and parts[2] == "artifacts":
            version = self._get(self.model_versions, parts[1], "model version")
            if method == "GET":
                items = [a for a in self.artifacts_of(version["id"])
                         if query.get("name") in (None, a.get("name"))
                         and query.get("artifactType") in (None, a["artifactType"])]
                return 200, _listing(items)
            if method == "POST":
                return 201, self._create_artifact(version, body)
        raise ApiError(404, f"no such endpoint: {method} {PREFIX}{path}")

    def _find(self, objects: dict[str, dict], name: str | None, parent: str | None) -> dict[str, Any]:
        if not name:
            raise ApiError(400, "name or externalId is required")
        for obj in objects.values():
            if obj["name"] == name and (parent is None or obj.get("registeredModelId") == parent):
                return obj
        raise ApiError(404, f"no object named {name!r}")

    def _get(self, objects: dict[str, dict], id_: str, what: str) -> dict[str, Any]:
        if not ID.match(id_):
            raise ApiError(400, f"invalid {what} id {id_!r}")
        if id_ not in objects:
            raise ApiError(404, f"{what} {id_} not found")
        return objects[id_]

    def _create_registered_model(self, body: Any) -> dict[str, Any]:
        _check_body(body, REGISTERED_MODEL_FIELDS, required=("name",))
        _check_enum(body, "state", LIVE_OR_ARCHIVED)
        if any(m["name"] == body["name"] for m in self.registered_models.values()):
            raise ApiError(409, f"registered model {body['name']!r} exists")
        return self._store(self.registered_models, {"state": "LIVE", **body})

    def _create_model_version(self, model: dict[str, Any], body: Any) -> dict[str, Any]:
        _check_body(body, MODEL_VERSION_FIELDS | {"id", "createTimeSinceEpoch", "lastUpdateTimeSinceEpoch"},
                    required=("name", "registeredModelId"))
        _check_enum(body, "state", LIVE_OR_ARCHIVED)
        if not isinstance(body["registeredModelId"], str) or not ID.match(body["registeredModelId"]):
            raise ApiError(400, f"registeredModelId {body['registeredModelId']!r} is not an id string")
        if body["registeredModelId"] != model["id"]:
            raise ApiError(400, "registeredModelId does not match the path")
        if any(v["name"] == body["name"] and v["registeredModelId"] == model["id"]
               for v in self.model_versions.values()):
            raise ApiError(409, f"model version {body['name']!r} exists")
        return self._store(self.model_versions, {"state": "LIVE", **body})

    def _create_artifact(self, version: dict[str, Any], body: Any) -> dict[str, Any]:
        if not isinstance(body, dict) or body.get("artifactType") != "model-artifact":
            raise ApiError(400, "artifactType must be one of the Artifact discriminator values "
                                "(this stand-in mirrors model-artifact only)")
        _check_body(body, MODEL_ARTIFACT_FIELDS, required=())
        _check_enum(body, "state", ARTIFACT_STATES)
        artifact = self._store(self.artifacts, {"state": "UNKNOWN", **body})
        self.artifact_version[artifact["id"]] = version["id"]
        return artifact

    def _store(self, objects: dict[str, dict], body: dict[str, Any]) -> dict[str, Any]:
        now = str(int(time.time() * 1000))
        obj = {**body, "id": str(self._next_id), "createTimeSinceEpoch": now, "lastUpdateTimeSinceEpoch": now}
        obj.setdefault("customProperties", {})
        self._next_id += 1
        objects[obj["id"]] = obj
        return obj

    # -- HTTP -------------------------------------------------------------------------------------
    def _handler(self) -> type[BaseHTTPRequestHandler]:
        standin = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # quiet
                pass

            def _serve(self, method: str) -> None:
                split = urlsplit(self.path)
                standin.requests.append((method, self.path))
                try:
                    if standin.token and self.headers.get("Authorization") != f"Bearer {standin.token}":
                        raise ApiError(401, "missing or wrong bearer token")
                    if not split.path.startswith(PREFIX + "/"):
                        raise ApiError(404, f"no such endpoint: {split.path}")
                    body = None
                    if method == "POST":
                        if self.headers.get("Content-Type") != "application/json":
                            raise ApiError(400, "Content-Type must be application/json")
                        try:
                            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                        except ValueError as exc:
                            raise ApiError(400, f"body is not JSON: {exc}") from None
                    query = {k: v[-1] for k, v in parse_qs(split.query).items()}
                    with standin._lock:
                        status, doc = standin.handle(method, split.path[len(PREFIX):], query, body)
                except ApiError as exc:
                    status, doc = exc.status, {"code": str(exc.status), "message": str(exc)}
                payload = json.dumps(doc).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def do_GET(self) -> None:
                self._serve("GET")

            def do_POST(self) -> None:
                self._serve("POST")

        return Handler


def _listing(items: list[dict[str, Any]]) -> dict[str, Any]:
    return {"items": items, "nextPageToken": "", "pageSize": len(items), "size": len(items)}


def _check_body(body: Any, allowed: set[str], required: tuple[str, ...]) -> None:
    if not isinstance(body, dict):
        raise ApiError(400, "body must be a JSON object")
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise ApiError(400, f"unknown fields {unknown}")
    for name in required:
        if not isinstance(body.get(name), str) or not body[name]:
            raise ApiError(400, f"{name} is required (a non-empty string)")
    for name in ("name", "description", "externalId"):
        if name in body and not isinstance(body[name], str):
            raise ApiError(400, f"{name} must be a string")
    _check_custom_properties(body.get("customProperties", {}))


def _check_custom_properties(props: Any) -> None:
    if not isinstance(props, dict):
        raise ApiError(400, "customProperties must be an object of MetadataValue")
    for key, value in props.items():
        kind = value.get("metadataType") if isinstance(value, dict) else None
        if kind not in METADATA_FIELDS:
            raise ApiError(400, f"customProperties[{key!r}]: metadataType {kind!r} is not a MetadataValue type")
        field, types = METADATA_FIELDS[kind]
        if set(value) != {"metadataType", field}:
            raise ApiError(400, f"customProperties[{key!r}]: a {kind} has exactly metadataType and {field}")
        v = value[field]
        if not isinstance(v, types) or (kind == "MetadataDoubleValue" and isinstance(v, bool)):
            raise ApiError(400, f"customProperties[{key!r}]: {field} {v!r} has the wrong type")
        if kind == "MetadataIntValue" and not INT32.match(v):
            raise ApiError(400, f"customProperties[{key!r}]: int_value {v!r} is not an int32 string")


def _check_enum(body: dict[str, Any], name: str, allowed: set[str]) -> None:
    if name in body and body[name] not in allowed:
        raise ApiError(400, f"{name} {body[name]!r} is not one of {sorted(allowed)}")
