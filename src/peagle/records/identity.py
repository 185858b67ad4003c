"""A draft's identity: one digest of what makes it that draft, one short fingerprint of it.

The **digest** is the sha256 of the lines ``<file>\\0<sha256 of the file>\\n`` for ``model.safetensors`` then
``config.json`` -- the weights and the config, nothing else (not where the draft lies, not when or by which run
it was published). It is computed the same way from

* a directory on local disk (each file hashed), e.g. what a vLLM server loaded (``peagle serve``, the chart's
  ``/mnt/models/draft``, the capture middleware);
* a publication (local or ``s3://``): the two files' sha256 as its verified ``_MANIFEST.json`` lists them, so a
  deploy step names a remote draft without downloading its weights.

The **fingerprint** is the digest's first :data:`FINGERPRINT_DIGITS` hex digits: what every place that names
a served draft records -- the chart's ``speculative.draftFingerprint`` (a pod label and part of a served model
name, so short), capture records' ``draft_fingerprint``, the trigger, the lineage, the gate, the rollout, the
promotion record and the registry's version name. Reports that store a draft's checksum (``gate.json``'s and
the evaluate report's ``sha256``) store the whole digest; :func:`fingerprint_of` shortens any spelling.

Spellings written before this scheme: a 64-digit ``draft_fingerprint`` (``peagle serve`` recorded the sha256 of
the two files' bytes concatenated) is shortened like a digest, so such records still name a draft, but the old
digest is not this one: records and gate reports written before it do not match a draft named now (see
docs/traffic.md, "Draft identity").
"""
from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path
from typing import Mapping

from pydantic import BaseModel, ConfigDict, field_validator

from ..errors import PeagleError
from ..storage import IncompletePrefixError, open_published, open_store
from ..storage.base import sha256_file

FINGERPRINT_DIGITS = 12
IDENTITY_FILES = ("model.safetensors", "config.json")  # the weights, then the config: what makes the draft
_DIGEST = re.compile(r"[0-9a-f]{64}")


class DraftIdentityError(PeagleError, ValueError):
    """A draft whose identity cannot be read (a missing file, an unpublished prefix); the message names it."""


class DraftIdentity(BaseModel):
    """A draft's :data:`digest <peagle.records.identity>` and the :attr:`fingerprint` every record carries."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    digest: str

    @field_validator("digest")
    @classmethod
    def _hex(cls, v: str) -> str:
        if not _DIGEST.fullmatch(v):
            raise ValueError("not 64 lowercase hex digits")
        return v

    @property
    def fingerprint(self) -> str:
        return self.digest[:FINGERPRINT_DIGITS]

    def names(self, spelling: str | None) -> bool:
        """Whether a recorded fingerprint or digest (``spelling``) names this draft."""
        return fingerprint_of(spelling) == self.fingerprint

    @classmethod
    def of_sums(cls, sums: Mapping[str, str]) -> "DraftIdentity":
        """The identity of a draft whose :data:`IDENTITY_FILES` have these sha256 sums."""
        lines = "".join(f"{name}\0{sums[name]}\n" for name in IDENTITY_FILES)
        return cls(digest=hashlib.sha256(lines.encode()).hexdigest())


def fingerprint_of(spelling: str | None) -> str | None:
    """The fingerprint a recorded spelling stands for: a whole digest shortened to :data:`FINGERPRINT_DIGITS`
    digits, a fingerprint as it is, None or "" as None."""
    if not spelling:
        return None
    return spelling[:FINGERPRINT_DIGITS] if _DIGEST.fullmatch(spelling) else spelling


def identify_draft(location: str | os.PathLike) -> DraftIdentity:
    """The identity of the draft at ``location``: a local directory holding :data:`IDENTITY_FILES` (hashed), else
    a publication (the sums of its verified manifest; a remote one is not downloaded)."""
    text = str(location)
    path = Path(text.removeprefix("file://")) if text.startswith("file://") or "://" not in text else None
    if path is not None and path.is_dir() and all((path / n).is_file() for n in IDENTITY_FILES):
        return DraftIdentity.of_sums({name: sha256_file(path / name)[1] for name in IDENTITY_FILES})
    try:
        published = open_published(open_store(str(location)), "")
    except IncompletePrefixError as exc:
        raise DraftIdentityError(f"{location}: neither a directory with {' and '.join(IDENTITY_FILES)} nor a "
                                 f"published draft ({exc})") from None
    missing = [n for n in IDENTITY_FILES if n not in published.manifest.keys]
    if missing:
        raise DraftIdentityError(f"{location}: the publication has no {missing[0]}: not a draft")
    return DraftIdentity.of_sums({name: published.manifest[name].sha256 for name in IDENTITY_FILES})
