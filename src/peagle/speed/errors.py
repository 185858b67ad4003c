"""Errors of the speed package (conventions of :mod:`peagle.errors`)."""
from __future__ import annotations

from ..errors import PeagleError


class ScheduleError(PeagleError, ValueError):
    """A speculation schedule cannot be read or does not fit where it is used; the message names it."""


def one_line(exc: Exception) -> str:
    """A pydantic ValidationError as ``field: message; ...`` (one line); other errors as they print."""
    errors = getattr(exc, "errors", None)
    if callable(errors):
        try:
            return "; ".join(f"{'.'.join(str(p) for p in e.get('loc', ())) or 'value'}: {e.get('msg', '')}"
                             for e in errors())
        except Exception:  # noqa: BLE001 - fall back to the text
            pass
    return str(exc)
