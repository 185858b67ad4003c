"""Errors raised by :mod:`peagle.storage`.

Every message names the object (as a URI) and, for S3, the endpoint -- never a credential.
Callers can catch :class:`StorageError` for "anything storage", or the subclasses below.
"""
from __future__ import annotations

from ..errors import PeagleError


class StorageError(PeagleError):
    """A storage operation failed; the message names the object URI (and S3 endpoint).

    ``attempts``: how many times the operation was tried (set by the retry loop; 1 if not retried).
    """

    attempts: int = 1


class StorageConfigError(StorageError, ValueError):
    """A storage URI or the storage environment is invalid (e.g. no bucket anywhere)."""


class InvalidKeyError(StorageConfigError):
    """An object key, prefix or URI path breaks the key rule (:func:`peagle.storage.check_key`)."""


class ObjectNotFoundError(StorageError, FileNotFoundError):
    """The object does not exist. Also a :class:`FileNotFoundError`, like a missing local file."""


class ChecksumMismatchError(StorageError):
    """An object's bytes do not hash to the sha256 recorded for it (corrupt or overwritten).

    ``uri`` names the object (shard), ``expected``/``actual`` are hex digests.
    """

    def __init__(self, uri: str, expected: str, actual: str, size: int | None = None):
        self.uri, self.expected, self.actual, self.size = uri, expected, actual, size
        got = f"{actual} ({size} bytes)" if size is not None else actual
        super().__init__(
            f"sha256 mismatch for {uri}: expected {expected}, got {got}; "
            "the object is corrupt or was overwritten after its manifest was written"
        )

    def __reduce__(self):  # keep picklable across processes (DataLoader workers, KFP)
        return (type(self), (self.uri, self.expected, self.actual, self.size))


class IncompletePrefixError(StorageError):
    """A prefix is not a complete publication (no ``_SUCCESS``, bad manifest, missing/short objects)."""


class DamagedPrefixError(IncompletePrefixError):
    """A prefix was published (``_SUCCESS`` and the manifest it vouches for are there) but an object
    its manifest names is missing or has another size: the message names that object. Not a
    publication still under way, which waiting would finish: the data changed after publication."""


class StorageTimeoutError(StorageError):
    """A storage operation did not finish within its time limit (all attempts and waits together);
    the message names the operation, the object URI and the endpoint."""


class PrefixExistsError(StorageError):
    """Refusing to publish over an already complete prefix without ``overwrite=True``."""
