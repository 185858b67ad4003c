"""What every loop record shares: a pydantic model checked when it is built and when it is read, one JSON form.

A :class:`Record` is frozen and strict: a document read must hold every field (a default serves only code that
builds a record), no other key is allowed,
and a value is taken as written, never coerced (a count ``"64"`` or a ``"passed": "false"`` is refused, not read
as 64 or as true). Its JSON object carries ``format`` (the class's :attr:`Record.FORMAT`) beside the fields.

Errors are the record's own error class (:attr:`Record.ERROR`), naming where and the field:
``<where>: field 'gate': not {...} or null (got [])``; where a record is built rather than read, ``where`` is
:meth:`Record.made_where` (e.g. ``decision <id>``). So a record that could not be read back is refused before it
is written anywhere.
"""
from __future__ import annotations

import json
from contextvars import ContextVar
from datetime import datetime, timezone
from typing import Annotated, Any, ClassVar, Mapping

from pydantic import AfterValidator, BaseModel, ConfigDict, ValidationError

from ..errors import PeagleError


_READING: ContextVar[str | None] = ContextVar("peagle_record_reading", default=None)  # where from_dict reads


class RecordError(PeagleError, ValueError):
    """A loop record that does not follow its format; the message names where and the field."""


def format_time(when: datetime) -> str:
    """``2026-12-03T15:04:05.123456Z`` (UTC, microseconds) -- the one timestamp form of the loop's records."""
    return when.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def parse_time(text: str) -> datetime:
    """An ISO 8601 timestamp as an aware UTC datetime (naive input is taken as UTC); ValueError if malformed."""
    when = datetime.fromisoformat(text[:-1] + "+00:00" if text.endswith("Z") else text)
    return when.replace(tzinfo=timezone.utc) if when.tzinfo is None else when.astimezone(timezone.utc)


def _timestamp(text: str) -> str:
    try:
        parse_time(text)
    except ValueError:
        raise ValueError("not an ISO 8601 timestamp") from None
    return text


Timestamp = Annotated[str, AfterValidator(_timestamp)]  # an ISO 8601 timestamp, kept as written


def short(value: Any) -> str:
    """``repr(value)``, cut to 80 characters (what an error message quotes of a bad value)."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


class Part(BaseModel):
    """A typed part of a record (strict, frozen, no other key); its errors are named by the record's field."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)


class Record(Part):
    """One loop record (see the module docstring). Subclasses set the class variables."""

    FORMAT: ClassVar[str]
    ERROR: ClassVar[type[Exception]] = RecordError
    WHAT: ClassVar[str] = "a record"  # "a decision record": the message when a document is not an object
    # field -> what it must be, said when a value is refused by its type (a validator's own message wins)
    WHY: ClassVar[Mapping[str, str]] = {}
    MADE: ClassVar[str] = ""  # how an error names a record being built, from its values: "decision {id}"

    def __init__(self, /, **values: Any):
        # pydantic calls an overridden __init__ from model_validate too: every check and error passes here
        try:
            super().__init__(**values)
        except ValidationError as exc:
            raise self.ERROR(self._message(exc, _READING.get() or self.made_where(values), values)) from None

    @classmethod
    def made_where(cls, values: Mapping[str, Any]) -> str:
        """How an error names a record being built (not read from anywhere): :attr:`MADE` filled in."""
        if not cls.MADE:
            return cls.WHAT.removeprefix("a ")
        return cls.MADE.format_map({name: values.get(name) for name in cls.model_fields})

    @classmethod
    def _message(cls, exc: ValidationError, where: str, values: Mapping[str, Any]) -> str:
        error = exc.errors()[0]
        if not error["loc"]:
            return f"{where}: {error['msg'].removeprefix('Value error, ')}"
        name = str(error["loc"][0])
        if error["type"] == "missing" and len(error["loc"]) == 1:
            return f"{where}: field {name!r}: missing"
        if error["type"] == "extra_forbidden" and len(error["loc"]) == 1:
            return f"{where}: field {name!r}: not a field of {cls.FORMAT}"
        why = (error["msg"].removeprefix("Value error, ") if error["type"] == "value_error"
               else cls.WHY.get(name, error["msg"]))
        return f"{where}: field {name!r}: {why} (got {short(values.get(name))})"

    @classmethod
    def from_dict(cls, d: Any, where: str):
        """Read one record strictly; the record's :attr:`ERROR` names ``where`` and the field."""
        if not isinstance(d, Mapping):
            raise cls.ERROR(f"{where}: {cls.WHAT} is a JSON object, got {type(d).__name__}")
        if d.get("format") != cls.FORMAT:
            raise cls.ERROR(f"{where}: field 'format': {d.get('format')!r} is not {cls.FORMAT!r}")
        missing = [name for name in cls.model_fields if name not in d]  # defaults are for building, not reading
        if missing:
            raise cls.ERROR(f"{where}: field {missing[0]!r}: missing")
        token = _READING.set(where)
        try:
            return cls(**{k: v for k, v in d.items() if k != "format"})
        finally:
            _READING.reset(token)

    @classmethod
    def from_json(cls, text: str | bytes, where: str):
        try:
            doc = json.loads(text)
        except ValueError as exc:
            raise cls.ERROR(f"{where}: not JSON: {exc}") from None
        return cls.from_dict(doc, where)

    def to_dict(self) -> dict[str, Any]:
        return {"format": self.FORMAT, **self.model_dump(mode="json")}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2) + "\n"

    def replace(self, **changes: Any):
        """A copy with ``changes``, checked as a new record is (pydantic's ``model_copy`` would not check)."""
        return type(self)(**{**{name: getattr(self, name) for name in type(self).model_fields}, **changes})
