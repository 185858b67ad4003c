"""The draft pointer: which published draft a release's pods serve when it is not the one their template names.

A promotion by swap (issue #41) changes the draft inside the running pods and leaves the pod template alone
(a template change would restart every pod). A pod that starts later -- rescheduled, scaled up, restarted
after a crash -- must serve the promoted draft too, so the rollout records it in a ConfigMap,
``<runtime>-draft`` (:func:`pointer_name`: the release's ServingRuntime name, so a canary, which renders
its own runtime, never reads the stable's pointer), with three keys:

* ``uri``: the published draft (``s3://`` with the pod's credentials, or a path the pod sees);
* ``fingerprint``: its fingerprint (:func:`peagle.records.identity.identify_draft`), what the pod checks it
  loads and then reports;
* ``template``: the draft fingerprint of the pod template the pointer overrides (the chart's
  ``peagle.io/draft-fingerprint`` label). A pod whose template names another draft ignores the pointer: a
  later ``peagle deploy`` (a new template) replaces a promotion made by swap, never the other way round.

The chart mounts the ConfigMap (``optional: true``: no pointer, the template's draft serves) at the
directory in :data:`POINTER_ENV` and puts the template's fingerprint in :data:`TEMPLATE_ENV`; the capture
middleware swaps to the pointed draft before the pod reports ready
(:class:`peagle.traffic.swap.StartupSwap`). The rollout reads the same ConfigMap to know what the stable
serves (:class:`peagle.rollout.cluster.ClusterBackend`). Pure: no vLLM, no Kubernetes client.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Mapping

from pydantic import Field, ValidationError, field_validator

from ..config import StrictModel
from ..errors import PeagleError

POINTER_ENV = "PEAGLE_DRAFT_POINTER"  # the directory the pointer ConfigMap is mounted at
TEMPLATE_ENV = "PEAGLE_TEMPLATE_DRAFT"  # the pod template's draft fingerprint
POINTER_MOUNT = "/etc/peagle/draft-pointer"  # where the chart mounts it
KEYS = ("uri", "fingerprint", "template")
_FINGERPRINT = re.compile(r"[0-9a-f]{8,64}")


class PointerError(PeagleError, ValueError):
    """A pointer that cannot be read (a key missing, a fingerprint that is not one)."""

    exit_code = 2


class DraftPointer(StrictModel):
    """The draft a release's pods serve over their template's (module docstring)."""

    uri: str = Field(min_length=1, description="the published draft")
    fingerprint: str = Field(description="its fingerprint")
    template: str = Field(description="the pod template's draft fingerprint this pointer overrides")

    @field_validator("fingerprint", "template")
    @classmethod
    def _hex(cls, v: str) -> str:
        if not _FINGERPRINT.fullmatch(v):
            raise ValueError(f"{v!r} is not a draft fingerprint (lower-case hex digits)")
        return v

    def applies_to(self, template: str | None) -> bool:
        """Whether this pointer overrides a pod template naming draft ``template``."""
        return bool(template) and template == self.template

    def as_data(self) -> dict[str, str]:
        """The ConfigMap's ``data``."""
        return {k: getattr(self, k) for k in KEYS}

    @classmethod
    def from_data(cls, data: Mapping[str, str], where: str) -> "DraftPointer":
        missing = [k for k in KEYS if not (data.get(k) or "").strip()]
        if missing:
            raise PointerError(f"{where}: draft pointer without {', '.join(missing)} (keys: {', '.join(KEYS)})")
        try:
            return cls(**{k: data[k].strip() for k in KEYS})
        except ValidationError as exc:
            errors = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
            raise PointerError(f"{where}: {errors}") from None


def pointer_name(runtime: str) -> str:
    """The pointer ConfigMap of the release whose ServingRuntime (or runtime name, deployment mode) is ``runtime``."""
    return f"{runtime}-draft"


def read_pointer(directory: str | Path) -> DraftPointer | None:
    """The pointer mounted at ``directory`` (one file per key), or None: no pointer (the ConfigMap does not exist,
    so the optional volume is empty, or the directory is missing)."""
    d = Path(directory)
    present = {k: (d / k).read_text() for k in KEYS if (d / k).is_file()}
    if not present:
        return None
    return DraftPointer.from_data(present, str(d))
