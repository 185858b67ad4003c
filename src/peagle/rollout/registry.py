"""A client of the OpenShift AI (Kubeflow) Model Registry REST API, ``/api/model_registry/v1alpha3``.

What a promotion needs, over plain HTTP (:class:`peagle.net.json_client.JsonHttpClient`: no SDK to pin):

* the registered model, found by name (``GET /registered_model?name=``) or created
  (``POST /registered_models``);
* one model version per promoted draft, named by the draft's fingerprint: found
  (``GET /model_version?name=&parentResourceId=``) or created (``POST /registered_models/{id}/versions``);
  an existing version of that name is reused, so a rerun of the same promotion registers nothing twice;
* its model artifact, the draft's URI (``GET``/``POST /model_versions/{id}/artifacts``), ``state`` LIVE.

Custom properties are a flat ``{name: str | int | float | bool}``: each becomes the API's tagged
``MetadataValue`` (``MetadataStringValue``, ``MetadataIntValue`` -- an int32 carried as a string --,
``MetadataDoubleValue``, ``MetadataBoolValue``); ``None`` values are left out.

The bearer token (:func:`bearer_token`) is the variable ``rollout.registry.token_env`` when it is set, else
the pod's ServiceAccount token (:data:`SERVICE_ACCOUNT_TOKEN`, what the Kubeflow Model Registry's own
Python client falls back to: a pipeline step's pod has it, and no step sets the variable), else none (no
Authorization header: a registry without authentication). A 401 or 403 says which token was sent.

Errors are :class:`ModelRegistryError` naming the method, the endpoint and the HTTP status (or the network
failure); the bearer token never appears in them (it is replaced by ``***`` should a server echo it).
No redirect is followed: urllib's would carry the Authorization header to wherever it points.
"""
from __future__ import annotations

import json
import math
import os
import urllib.parse
from pathlib import Path
from typing import Any, Mapping

from ..config import shorten
from ..errors import PeagleError
from ..records.promotion import Registration
from ..net.json_client import HttpError, InvalidJsonError, JsonHttpClient
from ..storage.settings import strip_userinfo
from .settings import RegistrySettings

API_PREFIX = "/api/model_registry/v1alpha3"
MODEL_FORMAT_NAME = "peagle-p-eagle-draft"  # what the artifact is: a vLLM-format P-EAGLE draft directory
MODEL_ARTIFACT = "model-artifact"  # the API's artifactType discriminator
_INT32_DIGITS = 9  # MetadataIntValue.int_value: "^-?([1-9][0-9]{0,8}|0)$"
_MESSAGE_LIMIT = 300  # characters of a server's error body shown in an error
# Mounted in every pod whose ServiceAccount token is not switched off (automountServiceAccountToken).
SERVICE_ACCOUNT_TOKEN = "/var/run/secrets/kubernetes.io/serviceaccount/token"

Property = str | int | float | bool | None


class ModelRegistryError(PeagleError, RuntimeError):
    """The registry refused a request or could not be reached; the message names the endpoint."""

    exit_code = 3


def metadata_value(name: str, value: str | int | float | bool) -> dict[str, Any]:
    """The ``MetadataValue`` of one custom property. An int beyond the API's int32 string pattern is
    carried as a string (exact); a NaN or infinite float is an error naming the property."""
    if isinstance(value, bool):  # before int: bool is an int
        return {"metadataType": "MetadataBoolValue", "bool_value": value}
    if isinstance(value, int):
        if len(str(abs(value))) <= _INT32_DIGITS:
            return {"metadataType": "MetadataIntValue", "int_value": str(value)}
        return {"metadataType": "MetadataStringValue", "string_value": str(value)}
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"custom property {name!r}: {value} is not a finite number")
        return {"metadataType": "MetadataDoubleValue", "double_value": value}
    if isinstance(value, str):
        return {"metadataType": "MetadataStringValue", "string_value": value}
    raise TypeError(f"custom property {name!r}: {type(value).__name__} is not str, int, float or bool")


def custom_properties(flat: Mapping[str, Property]) -> dict[str, dict[str, Any]]:
    """``customProperties`` of a flat dict; ``None`` values are left out (the API has no null value)."""
    return {name: metadata_value(name, value) for name, value in flat.items() if value is not None}


def bearer_token(settings: RegistrySettings, env: Mapping[str, str],
                 service_account_token: str | os.PathLike) -> tuple[str | None, str]:
    """``(token, where it came from)``: the variable ``settings.token_env`` when it is set and not empty,
    else the ServiceAccount token file when there is one, else ``(None, why none)``. The second item names
    the source for messages, never the token. A token file that is there but cannot be read is an error."""
    if env.get(settings.token_env):
        return env[settings.token_env], f"the variable {settings.token_env}"
    path = Path(service_account_token)
    try:
        token = path.read_text(encoding="utf-8").strip()
    except (FileNotFoundError, NotADirectoryError):
        return None, f"none: {settings.token_env} is not set and there is no ServiceAccount token at {path}"
    except (OSError, UnicodeDecodeError) as exc:
        raise ModelRegistryError(f"the ServiceAccount token {path} cannot be read ({type(exc).__name__}); "
                                 f"set {settings.token_env} to the registry's bearer token instead") from None
    if not token:
        return None, f"none: {settings.token_env} is not set and the ServiceAccount token {path} is empty"
    return token, f"the pod's ServiceAccount token ({path}; {settings.token_env} is not set)"


class ModelRegistryClient:
    """The few calls of the Model Registry REST API a promotion makes (see the module docstring)."""

    def __init__(self, url: str, token: str | None = None, timeout_s: float = 30.0, verify_tls: bool = True,
                 token_source: str = ""):
        """``token_source``: where ``token`` came from (never the token), said when the registry answers
        401 or 403."""
        base = url.rstrip("/")
        if not base.startswith(("http://", "https://")):
            raise ModelRegistryError(f"Model Registry URL {strip_userinfo(url)!r} is not an http(s) URL")
        self.url = base.removesuffix(API_PREFIX)
        self.timeout_s = timeout_s
        self.token_source = token_source or ("a token given to the client" if token else "none")
        # no redirect is followed: urllib's would carry the Authorization header to wherever it points
        self._http = JsonHttpClient(timeout_s=timeout_s, token=token, verify_tls=verify_tls,
                                    follow_redirects=False)

    @classmethod
    def from_settings(cls, settings: RegistrySettings, env: Mapping[str, str] | None = None, *,
                      service_account_token: str | os.PathLike | None = None) -> "ModelRegistryClient":
        """A client of ``settings.url`` with the bearer token :func:`bearer_token` finds: the variable
        ``settings.token_env`` of ``env`` (default ``os.environ``), else the ServiceAccount token file
        ``service_account_token`` (default :data:`SERVICE_ACCOUNT_TOKEN`), else no Authorization header."""
        env = os.environ if env is None else env
        token, source = bearer_token(settings, env, service_account_token or SERVICE_ACCOUNT_TOKEN)
        return cls(settings.url, token, settings.timeout_s, settings.verify_tls, token_source=source)

    # -- the objects ------------------------------------------------------------------------------
    def registered_model(self, name: str, *, description: str = "") -> dict[str, Any]:
        """The registered model ``name``, created if there is none."""
        found = self._request("GET", "/registered_model", query={"name": name}, missing_ok=True)
        if found is not None:
            return found
        body = {"name": name, "state": "LIVE", **({"description": description} if description else {})}
        created = self._request("POST", "/registered_models", body=body, conflict_ok=True)
        # 409: another process created it between our lookup and our create
        return created or self._request("GET", "/registered_model", query={"name": name})

    def model_version(self, registered_model_id: str, name: str, *, properties: Mapping[str, Property],
                      description: str = "", author: str = "peagle") -> tuple[dict[str, Any], bool]:
        """``(version, created)``: the version ``name`` of the registered model, created with
        ``properties`` if there is none (an existing one is returned as it is)."""
        query = {"name": name, "parentResourceId": registered_model_id}
        found = self._request("GET", "/model_version", query=query, missing_ok=True)
        if found is not None:
            return found, False
        body = {"name": name, "registeredModelId": registered_model_id, "state": "LIVE", "author": author,
                "customProperties": custom_properties(properties),
                **({"description": description} if description else {})}
        created = self._request("POST", f"/registered_models/{_id(registered_model_id)}/versions", body=body,
                                conflict_ok=True)
        if created is not None:
            return created, True
        return self._request("GET", "/model_version", query=query), False

    def model_artifact(self, model_version_id: str, *, name: str, uri: str, properties: Mapping[str, Property],
                       description: str = "", model_format_version: str = "") -> dict[str, Any]:
        """The model artifact ``name`` of the version, created (``uri``, LIVE) if the version has none."""
        path = f"/model_versions/{_id(model_version_id)}/artifacts"
        listing = self._request("GET", path, query={"name": name, "artifactType": MODEL_ARTIFACT})
        for item in listing.get("items") or []:
            if item.get("name") == name and item.get("artifactType") == MODEL_ARTIFACT:
                return item
        body = {"artifactType": MODEL_ARTIFACT, "name": name, "uri": uri, "state": "LIVE",
                "modelFormatName": MODEL_FORMAT_NAME, "customProperties": custom_properties(properties),
                **({"modelFormatVersion": model_format_version} if model_format_version else {}),
                **({"description": description} if description else {})}
        return self._request("POST", path, body=body)

    def register(self, *, model_name: str, version_name: str, uri: str, properties: Mapping[str, Property],
                 description: str = "", model_format_version: str = "") -> Registration:
        """Get-or-create the registered model, then its version ``version_name`` with ``properties`` and
        that version's model artifact at ``uri``. Idempotent: a rerun finds what the first run made."""
        model = self.registered_model(model_name, description="P-EAGLE drafts promoted by peagle rollouts")
        version, created = self.model_version(str(model["id"]), version_name, properties=properties,
                                              description=description)
        artifact = self.model_artifact(str(version["id"]), name=version_name, uri=uri, properties=properties,
                                       description=description, model_format_version=model_format_version)
        return Registration(url=strip_userinfo(self.url), registered_model_id=str(model["id"]),
                            registered_model_name=model_name, model_version_id=str(version["id"]),
                            model_version_name=version_name, model_artifact_id=str(artifact["id"]),
                            reused_version=not created)

    # -- HTTP -------------------------------------------------------------------------------------
    def _request(self, method: str, path: str, *, query: Mapping[str, str] | None = None,
                 body: Mapping[str, Any] | None = None, missing_ok: bool = False,
                 conflict_ok: bool = False) -> Any:
        """The decoded JSON answer; ``None`` for a 404 with ``missing_ok`` or a 409 with ``conflict_ok``."""
        endpoint = API_PREFIX + path + ("?" + urllib.parse.urlencode(query) if query else "")
        shown = f"Model Registry {method} {strip_userinfo(self.url)}{endpoint}"
        try:
            return self._http.request_json(method, self.url + endpoint, body)
        except HttpError as exc:
            if (exc.status == 404 and missing_ok) or (exc.status == 409 and conflict_ok):
                return None
            if exc.status is None:  # refused, DNS, TLS, timeout, cut off
                raise ModelRegistryError(self._redact(f"{shown}: cannot reach the registry ({exc.reason})")) from None
            if 300 <= exc.status < 400:
                where = strip_userinfo(exc.location)
                raise ModelRegistryError(self._redact(
                    f"{shown}: HTTP {exc.status}, a redirect to {shorten(where, 120)!r}, not followed (the token "
                    "goes to the registry's own address only): set rollout.registry.url to the address "
                    "that answers")) from None
            # the token is masked in the whole body first: a cut could leave a prefix of it unmasked
            message = self._redact(_server_message(exc.body))[:_MESSAGE_LIMIT]
            if exc.status in (401, 403):  # which token was refused (where it came from, never its value)
                message += f" (authorization sent: {self.token_source})"
            raise ModelRegistryError(self._redact(f"{shown}: HTTP {exc.status} {exc.reason}: {message}")) from None
        except InvalidJsonError as exc:
            raise ModelRegistryError(f"{shown}: the answer is not JSON ({exc.size} bytes)") from None

    def _redact(self, message: str) -> str:
        return self._http.mask(message)


def _id(value: str) -> str:
    """A server id put into a path: quoted, so an odd id cannot change the endpoint."""
    return urllib.parse.quote(str(value), safe="")


def _server_message(body: str) -> str:
    """The API's ``Error.message`` when the body is one, else the body's start."""
    try:
        doc = json.loads(body)
        text = str(doc.get("message") or doc) if isinstance(doc, dict) else str(doc)
    except ValueError:
        text = body
    return text.strip()
