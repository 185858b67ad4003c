"""The one error base of peagle's commands: what a command reports in one line, and its exit status.

Every entry point (``peagle``, ``peagle pipeline|evaluate|deploy``, ``python -m peagle.train``)
catches :class:`PeagleError` once and prints ``peagle: error: <message>`` (:func:`report`); the
exit status is the error class's :attr:`~PeagleError.exit_code`:

* 2 -- bad input, configuration or data (the default);
* 3 -- a measurement failed: vLLM or an endpoint broke off (``peagle evaluate``);
* 1 -- the deployment did not become usable, or its test request failed (``peagle deploy``).

Each stage keeps its own classes (:mod:`peagle.data.errors`, :mod:`peagle.storage.errors`, ...); they
subclass this one, and the builtin they always were (``ValueError``, ``RuntimeError``), so callers
catching those still do.
"""
from __future__ import annotations

import re
import sys


class PeagleError(Exception):
    """An error a command reports as ``peagle: error: <message>`` and exits with :attr:`exit_code`."""

    exit_code: int = 2


def report(exc: PeagleError) -> int:
    """Print ``peagle: error: <exc>`` on stderr; returns the exit status to leave with."""
    print(f"peagle: error: {exc}", file=sys.stderr)
    return exc.exit_code


_BEARER = re.compile(r"(?i)\bbearer\s+[^\s\"',;]+")


def mask_token(text: str, token: str | None) -> str:
    """``text`` with ``token`` and any ``Bearer <value>`` replaced by ``***``: for a message built from what
    a server answered, which may echo the request's credentials. Mask before cutting a message short (a
    cut could keep a prefix of the token)."""
    if token:
        text = text.replace(token, "***")
    return _BEARER.sub("Bearer ***", text)
