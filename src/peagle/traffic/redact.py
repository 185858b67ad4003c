"""Redaction of captured text before anything is written: ``[REDACTED:<name>]`` replaces each match.

The default set (``redact: [default]``, the capture's default), applied in this order:

* ``private_key`` -- PEM private key blocks (``-----BEGIN ... PRIVATE KEY-----`` through its END
  line, or to the end of the text when the block was cut off);
* ``jwt`` -- JSON Web Tokens: three base64url parts, the first two starting ``eyJ``;
* ``bearer`` -- ``Bearer <token>`` as in an Authorization header (the word and the token);
* ``api_key`` -- ``sk-``/``pk-``/``rk-`` style secret keys (OpenAI, Anthropic, Stripe: 20+ characters after
  the dash), GitHub tokens (``ghp_``, ``gho_``, ``ghu_``, ``ghs_``, ``ghr_``) and Slack tokens (``xox?-``);
* ``aws_access_key`` -- AWS access key ids (``AKIA``/``ASIA``/``ABIA``/``ACCA`` + 16 upper-case letters or digits);
* ``email`` -- e-mail addresses;
* ``card`` -- payment card numbers: 13 to 19 digits, optionally grouped by spaces or dashes, that pass
  the Luhn check (so most other long numbers stay);
* ``ipv4`` -- dotted-quad IPv4 addresses (each part 0-255);
* ``phone`` -- phone numbers written as such: international (``+`` country code, then 6 to 14 more
  digits in groups) or North American (``(415) 555-0100``, ``415-555-0100``, ``415.555.0100``);
  bare digit runs and dates are left alone.

Not covered by default: names, postal addresses, IPv6, national id numbers -- add ``re:<regex>``
entries for what a deployment must hide. A ``re:`` pattern's replacement is ``[REDACTED:custom]``.
Redaction is best-effort pattern matching, not a guarantee; capture stays off unless turned on.
This module imports only the standard library and :mod:`peagle.config`.
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from ..config import ConfigError

DEFAULT_PATTERNS: dict[str, str] = {
    "private_key": r"-----BEGIN (?:[A-Z0-9]+ )*PRIVATE KEY-----[\s\S]*?(?:-----END (?:[A-Z0-9]+ )*PRIVATE KEY-----|\Z)",
    "jwt": r"\beyJ[A-Za-z0-9_-]{2,}\.eyJ[A-Za-z0-9_-]{2,}\.[A-Za-z0-9_-]{8,}",
    "bearer": r"(?i)\bbearer\s+[A-Za-z0-9._~+/=-]{16,}",
    "api_key": r"\b(?:[sprk]k-[A-Za-z0-9_-]{20,}|gh[pousr]_[A-Za-z0-9]{30,}|xox[abprs]-[A-Za-z0-9-]{10,})",
    "aws_access_key": r"\b(?:AKIA|ASIA|ABIA|ACCA)[0-9A-Z]{16}\b",
    "email": r"\b[A-Za-z0-9._%+-]+@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*\.[A-Za-z]{2,}\b",
    "card": r"(?<![\d-])\d(?:[ -]?\d){12,18}(?![\d-])",
    "ipv4": r"(?<![\d.])(?:(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)\.){3}(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)(?!\.?\d)",
    "phone": r"(?<![\w+])(?:\+\d{1,3}(?:[ .-]?\(?\d{1,4}\)?)(?:[ .-]?\d{2,4}){1,4}"
             r"|\(\d{3}\)[ .-]?\d{3}[ .-]\d{4}|\d{3}([.-])\d{3}\1\d{4}|\d{3} \d{3} \d{4})(?!\w)",
}
CUSTOM = "custom"


def luhn_ok(digits: str) -> bool:
    """The Luhn checksum of a digit string (payment card numbers pass it)."""
    total = 0
    for i, ch in enumerate(reversed(digits)):
        d = int(ch) * (2 if i % 2 else 1)
        total += d - 9 if d > 9 else d
    return total % 10 == 0


def _digits(text: str) -> str:
    return "".join(ch for ch in text if ch.isdigit())


# A match of these patterns is only replaced when its check holds (fewer false positives).
_CHECKS: dict[str, Callable[[str], bool]] = {
    "card": lambda m: luhn_ok(_digits(m)),
    "phone": lambda m: 7 <= len(_digits(m)) <= 15,
}


@dataclass(frozen=True)
class Redactor:
    """Ordered ``(name, compiled pattern)`` pairs; :meth:`apply` replaces every match."""

    patterns: tuple[tuple[str, re.Pattern[str]], ...]

    @classmethod
    def from_settings(cls, names: Iterable[str]) -> "Redactor":
        """``names``: ``default`` (all of :data:`DEFAULT_PATTERNS`), a pattern name, or ``re:<regex>``.

        An unknown name or a regex that does not compile is a :class:`ConfigError` naming it.
        """
        chosen: dict[str, str] = {}
        for name in names:
            if name == "default":
                chosen.update(DEFAULT_PATTERNS)
            elif name.startswith("re:"):
                chosen[name] = name[3:]
            elif name in DEFAULT_PATTERNS:
                chosen[name] = DEFAULT_PATTERNS[name]
            else:
                raise ConfigError(f"redaction pattern {name!r} is unknown (known: default, "
                                  f"{', '.join(DEFAULT_PATTERNS)}, or re:<regex>)")
        compiled = []
        for key, regex in chosen.items():
            if not regex:
                raise ConfigError(f"redaction pattern {key!r}: empty regex")
            try:
                pattern = re.compile(regex)
            except re.error as e:
                raise ConfigError(f"redaction pattern {key!r}: not a valid regex: {e}") from None
            compiled.append((CUSTOM if key.startswith("re:") else key, pattern))
        return cls(tuple(compiled))

    def apply(self, text: str) -> tuple[str, int]:
        """``text`` with every match replaced by ``[REDACTED:<name>]``, and the number of replacements."""
        total = 0
        for name, pattern in self.patterns:
            check = _CHECKS.get(name)
            count = 0

            def replace(m: re.Match[str], name: str = name, check=check) -> str:
                nonlocal count
                if m.group(0) == "" or (check is not None and not check(m.group(0))):
                    return m.group(0)
                count += 1
                return f"[REDACTED:{name}]"

            text = pattern.sub(replace, text)
            total += count
        return text, total

    def apply_record(self, record: Any) -> Any:
        """A :class:`~peagle.traffic.record.TrafficRecord` with its message contents, prompt, response
        text and string sampling values redacted; ``redacted`` grows by the replacements made."""
        n = 0

        def red(value: Any) -> Any:
            nonlocal n
            if isinstance(value, str):
                value, k = self.apply(value)
                n += k
            elif isinstance(value, list):
                value = [red(v) for v in value]
            elif isinstance(value, dict):
                value = {k: red(v) for k, v in value.items()}
            return value

        messages = None if record.messages is None else [
            {"role": m["role"], "content": red(m["content"])} for m in record.messages]
        return dataclasses.replace(
            record, messages=messages, prompt=red(record.prompt), response_text=red(record.response_text),
            sampling=red(record.sampling), redacted=record.redacted + n)
