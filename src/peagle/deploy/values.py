"""Rules for the strings the deploy and pipeline code hands to Kubernetes: image references, object
names, label keys and values, resource names and quantities, object-store prefixes, storage URIs.

Each rule is a regular expression plus a length limit, written once here in the dialect both Python's
``re`` and Go's RE2 (which Helm's JSON-schema validator uses) read the same way: no look-arounds, no
``\\d``/``\\w`` (Unicode-wide in Python), anchors ``^...$`` (``$`` ends the text in RE2 and, with
:func:`re.fullmatch`, here too). ``charts/peagle-serving/values.schema.json`` carries the same rules
under ``definitions`` -- ``tests/integration/helm/test_deploy_values.py`` checks that they are identical and runs the
same good and bad examples through both -- so ``helm install --set image.tag=...`` fails at render
exactly where ``peagle deploy --image`` does.

:func:`check_capture` checks the chart's ``capture`` block against
:class:`peagle.traffic.settings.CaptureSettings` (the chart passes it to the middleware as
``PEAGLE_CAPTURE_*``), so ``peagle deploy`` names a bad ``capture.*`` key before Helm runs.

:func:`check` raises :class:`InvalidValue` saying why a value breaks its rule; the pydantic types
(:data:`ImageRef`, :data:`Quantity`, ...) apply the rules to the cluster profile's fields.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Annotated, Any, Callable, Mapping

from pydantic import AfterValidator, ValidationError

from ..config import short_repr
from ..errors import PeagleError
from ..traffic.settings import CaptureSettings

# -- building blocks (the OCI / Docker distribution reference grammar; Kubernetes' validation)
_ALNUM = "[a-z0-9]+"
_PATH_COMPONENT = f"{_ALNUM}(?:(?:[._]|__|-+){_ALNUM})*"  # lower case, '.', '_', '__' or '-'s between
_DOMAIN_COMPONENT = "(?:[A-Za-z0-9]|[A-Za-z0-9][A-Za-z0-9-]*[A-Za-z0-9])"
_IPV6 = r"\[[A-Fa-f0-9:]+\]"
# The first component names a registry only when it has a '.' or a port, is an IPv6 address or
# `localhost` -- otherwise it is a Docker Hub path component (as `docker pull` reads it) and must be lower case.
_DOMAIN = (f"(?:{_DOMAIN_COMPONENT}(?:\\.{_DOMAIN_COMPONENT})+(?::[0-9]+)?|{_DOMAIN_COMPONENT}:[0-9]+"
           f"|localhost|{_IPV6}(?::[0-9]+)?)")
_NAME = f"(?:{_DOMAIN}/)?{_PATH_COMPONENT}(?:/{_PATH_COMPONENT})*"
_TAG = "[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}"
_DIGEST = "[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,}"
_LABEL = "[a-z0-9](?:[-a-z0-9]*[a-z0-9])?"
_SUBDOMAIN = f"{_LABEL}(?:\\.{_LABEL})*"
_QUALIFIED_NAME = "[A-Za-z0-9](?:[-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"  # a label key's name part
# One segment of an object-store path: not '.' or '..', no '/', backslash or control characters
# (peagle.storage.base.check_key refuses the same, control characters included; the regex is kept so the
# chart schema, which has no Python to call, says it too).
_SEG_CHAR = r"[^/\\\x00-\x1f\x7f]"
_SEG_NODOT = r"[^/.\\\x00-\x1f\x7f]"
_SEGMENT = f"(?:{_SEG_NODOT}{_SEG_CHAR}*|\\.{_SEG_NODOT}{_SEG_CHAR}*|\\.\\.{_SEG_CHAR}+)"


@dataclass(frozen=True)
class Rule:
    """A string rule: ``pattern`` (anchored; it decides whether ``""`` passes) and at most ``max_length``
    characters."""

    pattern: str
    max_length: int
    description: str

    def schema(self) -> dict[str, Any]:
        """The JSON-schema form (``values.schema.json``'s ``definitions`` hold exactly this)."""
        return {"type": "string", "maxLength": self.max_length, "pattern": self.pattern}


RULES: dict[str, Rule] = {
    "imageRepository": Rule(f"^{_NAME}$", 255, "an image repository ([registry[:port]/]path, path components "
                            "lower case: a-z 0-9 separated by '.', '_', '__' or '-')"),
    "imageTag": Rule(f"^{_TAG}$", 128, "an image tag ([A-Za-z0-9_][A-Za-z0-9_.-]{0,127})"),
    "imageDigest": Rule(f"^{_DIGEST}$", 1024, "an image digest (algorithm:hex, e.g. sha256:<64 hex digits>)"),
    "objectName": Rule("^[a-z](?:[-a-z0-9]*[a-z0-9])?$", 53,
                       "an InferenceService/Deployment name: a DNS-1035 label (lower case letters, digits, '-', "
                       "starting with a letter) of at most 53 characters (Helm's release-name limit; KServe "
                       "appends -predictor)"),
    "dnsLabel": Rule(f"^{_LABEL}$", 63, "a DNS-1123 label (lower case letters, digits, '-'; at most 63)"),
    "dnsSubdomain": Rule(f"^{_SUBDOMAIN}$", 253,
                         "a DNS-1123 subdomain (lower case letters, digits, '-', '.'; at most 253)"),
    "labelKey": Rule(f"^(?:{_SUBDOMAIN}/)?{_QUALIFIED_NAME}$", 317,
                     "a label key ([DNS-1123 subdomain/]name, name: at most 63 of A-Z a-z 0-9 '-' '_' '.', "
                     "alphanumeric at both ends)"),
    "labelValue": Rule("^(?:[A-Za-z0-9](?:[-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?$", 63,
                       "a label value (at most 63 of A-Z a-z 0-9 '-' '_' '.', alphanumeric at both ends)"),
    "resourceName": Rule(f"^{_SUBDOMAIN}/{_QUALIFIED_NAME}$", 317,
                         "an extended resource name (domain/name, e.g. nvidia.com/gpu)"),
    "quantity": Rule(r"^(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][-+]?[0-9]+|[numkMGTPE]|[KMGTPE]i)?$", 64,
                     "a Kubernetes quantity (e.g. 500m, 4, 16Gi, 1.5G)"),
    "objectPrefix": Rule(f"^{_SEGMENT}(?:/{_SEGMENT})*/?$", 1024,
                         "a relative object-store path (no leading '/', no empty, '.' or '..' segments, no "
                         "backslash or control characters)"),
    "volumePath": Rule(f"^/?(?:{_SEGMENT}(?:/{_SEGMENT})*/?)?$", 1024,
                       "a path inside a volume (a leading '/' is the volume root; no empty, '.' or '..' segments, "
                       "no backslash or control characters)"),
    "storageUri": Rule(r"^[a-z][a-z0-9+.-]*://[^\x00-\x20\x7f]*$", 2048,
                       "a storage URI (scheme://..., no spaces or control characters)"),
    "text": Rule(r"^[^\x00-\x1f\x7f]*$", 1024, "text without control characters (newlines, tabs, ...)"),
}
_COMPILED = {k: re.compile(r.pattern) for k, r in RULES.items()}
_REFERENCE = re.compile(f"^(?P<repository>{_NAME})(?::(?P<tag>{_TAG}))?(?:@(?P<digest>{_DIGEST}))?$")


class InvalidValue(PeagleError, ValueError):
    """A value breaks its rule; ``str()`` says why (callers add which argument or field it was)."""


def _control_chars(value: str) -> str:
    """The first control character in ``value`` as an escape (``'\\n'``), or ``""``."""
    bad = next((c for c in value if ord(c) < 0x20 or ord(c) == 0x7f), "")
    return repr(bad)[1:-1] if bad else ""


def check(rule: str, value: Any) -> str:
    """``value`` if it obeys ``RULES[rule]``, else :class:`InvalidValue` naming the rule (and quoting at most
    the start of ``value``: it may be any length)."""
    r = RULES[rule]
    if not isinstance(value, str):
        raise InvalidValue(f"{short_repr(value)} is not a string; expected {r.description}")
    if len(value) > r.max_length:
        raise InvalidValue(f"{short_repr(value)} is too long ({len(value)} characters, at most {r.max_length}); "
                           f"expected {r.description}")
    if not _COMPILED[rule].fullmatch(value):
        ctl = _control_chars(value)
        why = f": it contains the control character {ctl}" if ctl else ""
        raise InvalidValue(f"{short_repr(value)} is not {r.description}{why}")
    return value


def parse_image(ref: str) -> tuple[str, str, str]:
    """``registry[:port]/path[:tag][@digest]`` -> (repository, tag, digest); a tag or a digest is required
    (an image left to ``latest`` is not reproducible). Tag and digest are ``""`` when absent."""
    what = "an image reference registry[:port]/path:tag or path[:tag]@algorithm:hex"
    if not isinstance(ref, str) or len(ref) > 255 + 1 + 128 + 1 + 1024:
        raise InvalidValue(f"{short_repr(ref)} is not {what}")
    m = _REFERENCE.fullmatch(ref)
    if not m:
        ctl = _control_chars(ref)
        why = f"it contains the control character {ctl}" if ctl else (
            "it contains a space" if " " in ref else "path components are lower case, tags [A-Za-z0-9_.-]")
        raise InvalidValue(f"{short_repr(ref)} is not {what}: {why}")
    repo, tag, digest = m.group("repository"), m.group("tag") or "", m.group("digest") or ""
    if len(repo) > RULES["imageRepository"].max_length:
        raise InvalidValue(f"{short_repr(ref)}: the repository is longer than 255 characters")
    if not tag and not digest:
        raise InvalidValue(f"{short_repr(ref)} has neither a tag nor a digest; give REPOSITORY:TAG or "
                           "REPOSITORY@sha256:...")
    return repo, tag, digest


def check_image(ref: str) -> str:
    """``ref`` if :func:`parse_image` accepts it."""
    parse_image(ref)
    return ref


def check_prefix(path: str) -> str:
    """An object-store prefix (``--path``): ``""`` (the bucket or volume root) or :data:`RULES` objectPrefix,
    and a prefix the storage layer accepts (:func:`peagle.storage.base.check_prefix`)."""
    from ..storage.base import check_prefix as storage_check_prefix

    if path == "":
        return path
    check("objectPrefix", path)
    try:
        return storage_check_prefix(path)
    except ValueError as exc:
        raise InvalidValue(str(exc)) from None


def check_flags(ns: Any, flag_rules: dict[str, Callable[[str], str]]) -> None:
    """Run each ``--flag``'s rule on its parsed value (argparse ``ns``; unset flags are skipped); raises
    :class:`InvalidValue` ``--flag: why`` for the first bad one -- the CLIs print ``peagle: error: ...``."""
    for flag, rule in flag_rules.items():
        value = getattr(ns, flag.lstrip("-").replace("-", "_"))
        if value is None:
            continue
        try:
            rule(value)
        except InvalidValue as e:
            raise InvalidValue(f"{flag}: {e}") from None


def rule_of(name: str) -> Callable[[str], str]:
    """``RULES[name]`` as a one-argument check."""
    RULES[name]  # noqa: B018 -- fail early on a misspelt rule
    return lambda value: check(name, value)


# pydantic field types for the cluster profile (errors name the field; see profile.load_profile)
ImageRef = Annotated[str, AfterValidator(check_image)]
OptionalImageRef = Annotated[str, AfterValidator(lambda v: v if v == "" else check_image(v))]  # "": the chart's
Quantity = Annotated[str, AfterValidator(rule_of("quantity"))]
ResourceName = Annotated[str, AfterValidator(rule_of("resourceName"))]
LabelKey = Annotated[str, AfterValidator(rule_of("labelKey"))]
LabelValue = Annotated[str, AfterValidator(rule_of("labelValue"))]
DnsLabel = Annotated[str, AfterValidator(rule_of("dnsLabel"))]
DnsSubdomain = Annotated[str, AfterValidator(rule_of("dnsSubdomain"))]


# -- the chart's `capture` block (peagle.traffic): its keys and the CaptureSettings field each one sets
CAPTURE_VALUES: dict[str, str] = {
    "enabled": "enabled", "uri": "uri", "sampleRate": "sample_rate", "flushIntervalSeconds": "flush_interval_s",
    "batchRecords": "batch_records", "queueRecords": "queue_records", "maxRecordBytes": "max_record_bytes",
    "retentionDays": "retention_days", "redact": "redact",
}
# Where the credentials or the volume of the log come from: the pod's wiring, not a capture setting.
CAPTURE_WIRING = ("s3SecretName", "pvc")
# Fields the chart fills from what it serves, not from values.
CAPTURE_FROM_CHART = ("target_dir", "draft_dir", "target_fingerprint", "draft_fingerprint")


def check_capture_uri(uri: str) -> str:
    """A traffic log root the chart can wire: ``s3://bucket/prefix`` or an absolute path (a mounted claim)."""
    if isinstance(uri, str) and uri.startswith("s3://"):
        return check("storageUri", uri)
    if isinstance(uri, str) and uri.startswith("/") and uri != "/":
        return check("volumePath", uri)
    raise InvalidValue(f"{short_repr(uri)} is not s3://bucket/prefix or an absolute path on a mounted claim")


def check_capture(capture: Any) -> CaptureSettings | None:
    """The chart's ``capture`` values as :class:`CaptureSettings` (``None`` when capture is off).

    Keys not given take the chart's defaults, which are CaptureSettings' defaults. Raises
    :class:`InvalidValue` ``capture.<key>: why`` for an unknown key, a value the settings refuse,
    ``enabled`` without ``uri``, or a ``uri`` whose credentials or volume are not named
    (``s3SecretName`` for s3://, ``pvc.claimName`` for a path)."""
    if capture is None:
        return None
    if not isinstance(capture, Mapping):
        raise InvalidValue(f"capture: {short_repr(capture)} is not a mapping")
    known = (*CAPTURE_VALUES, *CAPTURE_WIRING)
    for key in capture:
        if key not in known:
            raise InvalidValue(f"capture.{key}: unknown key (known: {', '.join(known)})")
    pvc = capture.get("pvc") or {}
    if not isinstance(pvc, Mapping):
        raise InvalidValue(f"capture.pvc: {short_repr(pvc)} is not a mapping")
    for key in pvc:
        if key not in ("claimName", "path"):
            raise InvalidValue(f"capture.pvc.{key}: unknown key (known: claimName, path)")
    for key, rule, value in (("s3SecretName", "dnsSubdomain", capture.get("s3SecretName", "")),
                             ("pvc.claimName", "dnsSubdomain", pvc.get("claimName", "")),
                             ("pvc.path", "volumePath", pvc.get("path", ""))):
        if value != "":
            try:
                check(rule, value)
            except InvalidValue as e:
                raise InvalidValue(f"capture.{key}: {e}") from None
    fields = {field: capture[key] for key, field in CAPTURE_VALUES.items() if key in capture}
    try:
        # strict, as the chart's schema is: `helm --set capture.sampleRate=0.5` passes the string "0.5"
        settings = CaptureSettings.model_validate(fields, strict=True)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = next((f"capture.{k}" for k, f in CAPTURE_VALUES.items() if err["loc"] and f == err["loc"][0]), "capture")
        raise InvalidValue(f"{where}: {err['msg']} (got {short_repr(err.get('input'))})") from None
    if not settings.enabled:
        return None
    if not settings.uri:
        raise InvalidValue("capture.uri is required with capture.enabled=true (s3://bucket/prefix, or an "
                           "absolute path on capture.pvc)")
    try:
        check_capture_uri(settings.uri)
    except InvalidValue as e:
        raise InvalidValue(f"capture.uri: {e}") from None
    if settings.uri.startswith("s3://") and not capture.get("s3SecretName"):
        raise InvalidValue("capture.s3SecretName is required with an s3:// capture.uri: the Secret (e.g. an "
                           "OpenShift AI data connection) holding the S3 credentials")
    if settings.uri.startswith("/") and not pvc.get("claimName"):
        raise InvalidValue("capture.pvc.claimName is required with a path capture.uri: the claim mounted there")
    return settings
