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
  the Luhn check (so most other long numbers stay). Every card-length candidate inside a longer run of
  digits is tried (a card followed by its CVV, an expiry or an address is still found): candidates start
  and end at the run's groups, or anywhere inside an ungrouped block of 13 or more digits;
* ``ipv4`` -- dotted-quad IPv4 addresses (each part 0-255);
* ``phone`` -- phone numbers written as such: international (``+`` country code, then 6 to 14 more
  digits in groups) or North American (``(415) 555-0100``, ``415-555-0100``, ``415.555.0100``);
  bare digit runs and dates are left alone.

Not covered by default: names, postal addresses, IPv6, national id numbers -- add ``re:<regex>``
entries for what a deployment must hide. A ``re:`` pattern's replacement is ``[REDACTED:custom]``.
Matching runs on the text after Unicode NFKC normalisation (full-width forms become ASCII) with format
characters (category Cf: zero-width spaces and joiners, bidi marks, soft hyphens) removed; that
normalised text is what is stored. Common Cyrillic and Greek look-alikes of Latin letters and digits
match as the Latin character they imitate (the stored text keeps them where no secret matched).
Redaction is best-effort pattern matching, not a guarantee; capture stays off unless turned on.
This module imports only the standard library and :mod:`peagle.config`.
"""
from __future__ import annotations

import dataclasses
import re
import unicodedata
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from ..config import ConfigError

DEFAULT_PATTERNS: dict[str, str] = {
    "private_key": r"-----BEGIN (?:[A-Z0-9]+ )*PRIVATE KEY(?: BLOCK)?-----[\s\S]*?"
                   r"(?:-----END (?:[A-Z0-9]+ )*PRIVATE KEY(?: BLOCK)?-----|\Z)",
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

# Look-alikes of Latin letters and digits (Cyrillic and Greek), matched as the character they imitate.
# One character for one, so that a match's span in the skeleton is its span in the text.
_LOOKALIKES = str.maketrans(
    "АВЕКМНОРСТУХЅІЈаеорсухѕіјԁһӏ"  # Cyrillic
    "ΑΒΕΖΗΙΚΜΝΟΡΤΥΧαικνορτυχ",  # Greek
    "ABEKMHOPCTYXSIJaeopcyxsijdhl"
    "ABEZHIKMNOPTYXaikvoptux")
_DIGIT_RUN = re.compile(r"\d(?:[ -]?\d)*")
CARD_DIGITS = (13, 19)


def normalize(text: str) -> str:
    """NFKC with format characters (Unicode category Cf) removed: what redaction matches and stores."""
    text = unicodedata.normalize("NFKC", text)
    return "".join(ch for ch in text if unicodedata.category(ch) != "Cf")


def skeleton(text: str) -> str:
    """``text`` with look-alike letters replaced by the Latin ones they imitate (same length)."""
    return text.translate(_LOOKALIKES)


def card_spans(text: str) -> list[tuple[int, int]]:
    """Spans of ``text`` holding a Luhn-valid 13-19 digit card number, tried at every candidate: runs
    of digits (grouped by single spaces or dashes) are cut at their groups, and an ungrouped block of
    13 or more digits at every digit; leftmost start first, the longest candidate there."""
    spans = []
    for run in _DIGIT_RUN.finditer(text):
        pos = [run.start() + i for i, ch in enumerate(run.group(0)) if ch.isdigit()]
        if len(pos) < CARD_DIGITS[0]:
            continue
        digits = "".join(text[i] for i in pos)
        groups, start = [], 0  # (first, last+1) digit indices of each group
        for k in range(1, len(pos) + 1):
            if k == len(pos) or pos[k] != pos[k - 1] + 1:
                groups.append((start, k))
                start = k
        starts, ends = set(), set()
        for a, b in groups:
            inner = range(a, b + 1) if b - a >= CARD_DIGITS[0] else (a, b)
            starts.update(i for i in inner if i < b)
            ends.update(i for i in inner if i > a)
        i = 0
        while i < len(pos):
            found = None
            if i in starts:
                for n in range(CARD_DIGITS[1], CARD_DIGITS[0] - 1, -1):
                    if i + n in ends and i + n <= len(pos) and luhn_ok(digits[i:i + n]):
                        found = n
                        break
            if found is None:
                i += 1
                continue
            spans.append((pos[i], pos[i + found - 1] + 1))
            i += found
    return spans


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
        """``text`` normalised (:func:`normalize`) with every match replaced by ``[REDACTED:<name>]``, and
        the number of replacements. Patterns match the :func:`skeleton` of the text."""
        if not self.patterns:
            return text, 0
        text = normalize(text)
        total = 0
        for name, pattern in self.patterns:
            check = _CHECKS.get(name)
            shape = skeleton(text)
            if name == "card":
                spans = card_spans(shape)
            else:
                spans = [m.span() for m in pattern.finditer(shape)
                         if m.group(0) != "" and (check is None or check(m.group(0)))]
            for a, b in reversed(spans):
                text = f"{text[:a]}[REDACTED:{name}]{text[b:]}"
            total += len(spans)
        return text, total

    def apply_record(self, record: Any) -> Any:
        """A :class:`~peagle.traffic.record.TrafficRecord` with every string it stores redacted (message
        contents, prompt, response text, model name, sampling values) and a sampling number that matches a
        pattern (a card number given as a seed) replaced by null; ``redacted`` grows by the replacements."""
        n = 0

        def red(value: Any) -> Any:
            nonlocal n
            if isinstance(value, str):
                value, k = self.apply(value)
                n += k
            elif isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10 ** 6:
                k = self.apply(str(value))[1]
                n += k
                value = None if k else value
            elif isinstance(value, list):
                value = [red(v) for v in value]
            elif isinstance(value, dict):
                value = {k: red(v) for k, v in value.items()}
            return value

        messages = None if record.messages is None else [
            {"role": m["role"], "content": red(m["content"])} for m in record.messages]
        return dataclasses.replace(
            record, messages=messages, prompt=red(record.prompt), response_text=red(record.response_text),
            model=red(record.model), sampling=red(record.sampling), redacted=record.redacted + n)
