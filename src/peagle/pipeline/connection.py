"""The data connection a run reads its S3 settings from, checked before any work.

An OpenShift AI data connection is a Secret with the ``AWS_*`` keys. The dashboard's S3 connection
type makes Bucket optional and drops empty fields from the Secret, so a connection may lack
``AWS_S3_BUCKET``. The pipeline steps therefore take no key as a required env var (a missing one would
hold the pod in CreateContainerConfigError for ever): they read the Secret mounted as files
(``$PEAGLE_DATA_CONNECTION_DIR``, an optional volume), and the TrainJob's nodes get optional
``secretKeyRef`` env plus the connection's name (:data:`DATA_CONNECTION_ENV`).

:func:`check_data_connection` is what the first step (``init_run``) and each training node run first:
it fails naming the missing key and the connection when a URI of the run needs what the connection
does not have.
"""
from __future__ import annotations

import os
from typing import Mapping

from ..config import short_repr
from ..errors import PeagleError
from ..storage.settings import DATA_CONNECTION_DIR_ENV, with_mounted_connection
from ..storage.uri import parse_uri

DATA_CONNECTION_ENV = "PEAGLE_DATA_CONNECTION"  # the connection's (Secret's) name, for messages
BUCKET_KEY = "AWS_S3_BUCKET"


class DataConnectionError(PeagleError, ValueError):
    """The run's data connection lacks a key the run needs (the message names both)."""


def _bucketless(uri: str) -> bool:
    """True for ``s3:///prefix``: a URI that takes its bucket from the connection."""
    try:
        parsed = parse_uri(uri)
    except Exception:  # noqa: BLE001 - a malformed URI is reported where it is used, with its own message
        return False
    return parsed.scheme == "s3" and not parsed.bucket


def check_data_connection(name: str, uris: Mapping[str, str], env: Mapping[str, str] | None = None) -> None:
    """Fail (:class:`DataConnectionError`) when data connection ``name`` cannot serve ``uris``.

    ``uris``: what the run reads or writes, by the setting that names it (``{"output_root": ...}``).
    The connection's keys are the environment plus the Secret mounted at ``$PEAGLE_DATA_CONNECTION_DIR``.
    Checked: a mounted Secret with no keys at all (the Secret does not exist in the namespace: its
    volume is optional), and ``AWS_S3_BUCKET`` for a URI that names no bucket (``s3:///...``). Without a
    connection name (kfp.local runs, the CLI) nothing is checked.
    """
    if not name:
        return
    env = os.environ if env is None else env
    directory = env.get(DATA_CONNECTION_DIR_ENV)
    label = f"data connection {short_repr(name)}"
    if directory and os.path.isdir(directory) and not any(
            not f.startswith(".") and os.path.isfile(os.path.join(directory, f)) for f in os.listdir(directory)):
        raise DataConnectionError(
            f"{label} has no keys (nothing mounted at {directory}): does the Secret exist in this namespace? "
            "Create the connection in the project (OpenShift AI dashboard: Connections) or pass the name of one "
            "as the pipeline parameter data_connection")
    keys = with_mounted_connection(env)
    if keys.get(BUCKET_KEY):
        return
    for setting, uri in uris.items():
        if uri and _bucketless(str(uri)):
            raise DataConnectionError(
                f"{label} has no {BUCKET_KEY} (its Bucket field is empty), and {setting} {short_repr(str(uri))} "
                f"names no bucket: add the bucket to the connection, or name it in the URI (s3://BUCKET/...)")
