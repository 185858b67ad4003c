"""Redaction of captured text before anything is written: ``[REDACTED:<name>]`` replaces each match.

The default set (``redact: [default]``, the capture's default), applied in this order:

* ``private_key`` -- PEM and PGP private key blocks (``-----BEGIN ... PRIVATE KEY[ BLOCK]-----``, in upper
  or lower case, through its END line, or to the end of the text when the block was cut off);
* ``jwt`` -- JSON Web Tokens: three base64url parts, the first two starting ``eyJ`` (the first part is
  redacted whole, with whatever letters, digits, ``-`` or ``_`` are glued before its ``eyJ``);
* ``bearer`` -- ``Bearer <token>`` as in an Authorization header (the word and the token);
* ``api_key`` -- ``sk-``/``pk-``/``rk-`` style secret keys (OpenAI, Anthropic: 20+ characters after the
  dash), Stripe keys (``sk_live_``, ``pk_test_``, ``rk_live_``, ...), GitHub tokens (``ghp_``, ``gho_``,
  ``ghu_``, ``ghs_``, ``ghr_``, ``github_pat_``) and Slack tokens (``xox?-``),
  also right after digits or ``_`` (not after a letter: ``task-...`` is a word);
* ``aws_access_key`` -- AWS access key ids (``AKIA``/``ASIA``/``ABIA``/``ACCA`` + 16 upper-case letters or
  digits), wherever they stand, even glued to other letters or digits;
* ``email`` -- e-mail addresses (digits glued after the domain do not hide one);
* ``ipv4`` -- dotted-quad IPv4 addresses (each part 0-255);
* ``card`` -- payment card numbers: 13 to 19 digits that pass the Luhn check, in a run of digits grouped
  by single spaces or dashes. Every 13-19-digit slice of such a run is tried, starting and ending at any
  digit, and overlapping valid slices are joined, so a card with a CVV, an expiry or other digits before
  or after it is covered whole -- and a run of 13 or more digits that is no card often loses a part of
  it (a Luhn-valid slice) too;
* ``phone`` -- phone numbers written as such: international (``+`` country code, then 6 to 14 more
  digits in groups) or North American (``(415) 555-0100``, ``415-555-0100``, ``415.555.0100``);
  bare digit runs and dates are left alone.

Not covered by default: names, postal addresses, IPv6, national id numbers -- add ``re:<regex>``
entries for what a deployment must hide. A ``re:`` pattern's replacement is ``[REDACTED:custom]``.
Matching runs on the text after Unicode NFKC normalisation (full-width and mathematical forms become
ASCII) with format characters (category Cf: zero-width spaces and joiners, bidi marks, soft hyphens)
removed; that normalised text is what is stored. Common Cyrillic and Greek look-alikes of Latin letters,
the decimal digits of other scripts (Arabic-Indic, Devanagari, ...), and the dashes and stops NFKC keeps
(hyphen, en/em dash, minus sign, ideographic full stop) match as the Latin letter, ASCII digit, ``-`` or
``.`` they stand for (the stored text keeps them where no secret matched). The normalised text is stored,
not the original: NFKC changes lengths (a ligature becomes two letters), so a match could not be mapped
back to the original exactly; the look-alike reading keeps lengths and is used for matching only. Every pattern runs in
time linear in the text (a hostile megabyte does not stall the writer).

Redaction is best-effort pattern matching, not a guarantee; capture stays off unless turned on. Not
found: a secret split by the client across two messages or fields; secrets of no class above (add
``re:`` patterns); a secret spelt out or encoded (base64 of a key, a character per line, separators
other than those above, e.g. a card grouped by dots); a bearer token glued to a letter before it, an
IPv4 address or a phone number glued to other digits; look-alikes from other scripts (Armenian,
Cherokee, ...) or combining marks inside a secret; e-mail addresses with non-ASCII letters (only their
ASCII part is replaced).
This module imports only the standard library and :mod:`peagle.config`.
"""
from __future__ import annotations

import json
import re
import unicodedata
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from ..config import ConfigError

DEFAULT_PATTERNS: dict[str, str] = {
    "private_key": r"(?i)-----BEGIN (?:[A-Z0-9]+ )*PRIVATE KEY(?: BLOCK)?-----[\s\S]*?"
                   r"(?:-----END (?:[A-Z0-9]+ )*PRIVATE KEY(?: BLOCK)?-----|\Z)",
    # The first part starts where its run of base64url characters starts (a check wants 'eyJ' in it): one
    # attempt per run, so a long 'eyJ-eyJ-...' takes linear time, and a token glued to a word is found.
    "jwt": r"(?<![A-Za-z0-9_-])[A-Za-z0-9_-]{5,}\.eyJ[A-Za-z0-9_-]{2,}\.[A-Za-z0-9_-]{8,}",
    # Letters before a key's prefix make it part of a word (task-...); digits and '_' do not.
    "bearer": r"(?i)(?<![a-z])bearer\s+[A-Za-z0-9._~+/=-]{16,}",
    "api_key": r"(?<![A-Za-z])(?:[sprk]k-[A-Za-z0-9_-]{20,}|[spr]k_(?:live|test)_[A-Za-z0-9]{16,}"
               r"|gh[pousr]_[A-Za-z0-9]{30,}|github_pat_[A-Za-z0-9_]{22,}|xox[abprs]-[A-Za-z0-9-]{10,})",
    "aws_access_key": r"(?:AKIA|ASIA|ABIA|ACCA)[0-9A-Z]{16}",  # even inside a longer word or number
    # A local part starts where a run of its characters starts: one attempt per run, not one per
    # character (a long 'a.a.a...' without '@' would take quadratic time); digits may follow the domain.
    "email": r"(?<![A-Za-z0-9._%+-])[A-Za-z0-9._%+-]+@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*\.[A-Za-z]{2,}(?![A-Za-z])",
    # Before card: a card's candidates may run on into the address's first part.
    "ipv4": r"(?<!\d)(?<!\d\.)(?:(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)\.){3}(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)(?!\.?\d)",
    "card": r"[0-9](?:[ -]?[0-9])*",  # a run of digits; card_spans tries every card-length slice of it
    "phone": r"(?:(?<!\d)\+\d{1,3}(?:[ .-]?\(?\d{1,4}\)?)(?:[ .-]?\d{2,4}){1,4}"
             r"|(?<![\d+])(?:\d{3}([.-])\d{3}\1\d{4}|\d{3} \d{3} \d{4})|\(\d{3}\)[ .-]?\d{3}[ .-]\d{4})(?!\d)",
}
CUSTOM = "custom"

# Look-alikes of Latin letters (Cyrillic and Greek), matched as the letter they imitate, and separators
# NFKC keeps (hyphen, figure/en/em dash, bar, minus sign; the ideographic full stop), matched as '-' and '.'.
# One character for one, so that a match's span in the skeleton is its span in the text.
_LOOKALIKES = str.maketrans(
    "АВЕКМНОРСТУХЅІЈҮԚԜаеорсухѕіјԁһӏүԛԝ"  # Cyrillic
    "ΑΒΕΖΗΙΚΜΝΟΡΤΥΧͿαικνορτυχϳ"  # Greek (the lunate sigmas, Ϲ and ϲ, are a plain sigma after NFKC)
    "\u2010\u2012\u2013\u2014\u2015\u2212\u3002",
    "ABEKMHOPCTYXSIJYQWaeopcyxsijdhlyqw"
    "ABEZHIKMNOPTYXJaikvoptuxj"
    "------.")
_OTHER_DIGIT = re.compile(r"(?![0-9])\d")  # a decimal digit of another script (Arabic-Indic, Devanagari, ...)
_DIGIT_RUN = re.compile(DEFAULT_PATTERNS["card"])
CARD_DIGITS = (13, 19)


def normalize(text: str) -> str:
    """NFKC with format characters (Unicode category Cf) removed: what redaction matches and stores (a
    match in it has no exact span in the original text, whose length NFKC may change)."""
    text = unicodedata.normalize("NFKC", text)
    return "".join(ch for ch in text if unicodedata.category(ch) != "Cf")


def skeleton(text: str) -> str:
    """``text`` with look-alike letters replaced by the Latin ones they imitate and the decimal digits of
    other scripts by ASCII digits (one character for one: the same length)."""
    text = _OTHER_DIGIT.sub(lambda m: str(unicodedata.decimal(m.group(0))), text)
    return text.translate(_LOOKALIKES)


def card_spans(text: str) -> list[tuple[int, int]]:
    """Spans of ``text`` covering every Luhn-valid 13-19 digit card number in it: every slice of that many
    digits of a run of digits (grouped by single spaces or dashes) is tried, starting and ending at any of
    its digits, and overlapping valid slices are joined (a card with digits glued before or after it, a
    CVV, an expiry, is covered whole)."""
    spans: list[tuple[int, int]] = []
    low, high = CARD_DIGITS
    for run in _DIGIT_RUN.finditer(text):
        pos = [run.start() + i for i, ch in enumerate(run.group(0)) if ch != " " and ch != "-"]
        if len(pos) < low:
            continue
        luhn = _luhn_sums("".join(text[i] for i in pos))
        cover_to = -1  # the digit index the current joined span reaches (exclusive)
        for i in range(len(pos) - low + 1):
            last = max((e for e in range(min(i + high, len(pos)), i + low - 1, -1) if luhn(i, e)), default=None)
            if last is None:
                continue
            if spans and i < cover_to:
                spans[-1] = (spans[-1][0], max(spans[-1][1], pos[last - 1] + 1))
            else:
                spans.append((pos[i], pos[last - 1] + 1))
            cover_to = max(cover_to, last)
    return spans


def _luhn_sums(digits: str) -> Callable[[int, int], bool]:
    """``ok(i, e)``: whether ``digits[i:e]`` passes the Luhn check, in constant time (prefix sums of the
    digits with the odd, or the even, positions doubled: the rightmost digit of a slice is never doubled),
    so that trying every card-length slice of a long run stays linear."""
    sums = ([0], [0])  # sums[p][k]: digits[:k] with the positions j % 2 != p doubled
    for j, ch in enumerate(digits):
        d = int(ch)
        twice = d * 2 - 9 if d > 4 else d * 2
        for p in (0, 1):
            sums[p].append(sums[p][-1] + (twice if j % 2 != p else d))
    return lambda i, e: (sums[(e - 1) % 2][e] - sums[(e - 1) % 2][i]) % 10 == 0


def luhn_ok(digits: str) -> bool:
    """The Luhn checksum of a digit string (payment card numbers pass it)."""
    total = 0
    for i, ch in enumerate(reversed(digits)):
        d = int(ch) * (2 if i % 2 else 1)
        total += d - 9 if d > 9 else d
    return total % 10 == 0


def _digits(text: str) -> str:
    return "".join(ch for ch in text if ch.isdigit())


def _phone_length(match: str) -> int | None:
    """How much of a phone match to replace: all of it when it has 7 to 15 digits; when it has more (digits
    written right after the number), up to the last separator that leaves 7 to 15; else nothing."""
    end = len(match)
    while end > 0:
        n = len(_digits(match[:end]))
        if n < 7:
            return None
        if n <= 15:
            return end
        end = max(match.rfind(sep, 0, end) for sep in " .-")
    return None


# How much of a match of these patterns to replace (None: nothing), fewer false positives.
_CHECKS: dict[str, Callable[[str], int | None]] = {
    "jwt": lambda m: len(m) if "eyJ" in m.partition(".")[0] else None,
    "phone": _phone_length,
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
                spans = []
                for m in pattern.finditer(shape):
                    keep = len(m.group(0)) if check is None else check(m.group(0))
                    if keep:
                        spans.append((m.start(), m.start() + keep))
            for a, b in reversed(spans):
                text = f"{text[:a]}[REDACTED:{name}]{text[b:]}"
            total += len(spans)
        return text, total

    def apply_record(self, record: Any) -> Any:
        """A :class:`~peagle.records.traffic.TrafficRecord` with every string it stores redacted (message
        contents, prompt, response text, model name, sampling values) and a sampling number of a million or
        more that a pattern matches (a card number given as a seed, an integer or a float, as written or by
        its digits) replaced by null; ``redacted`` grows by the replacements."""
        n = 0

        def red(value: Any) -> Any:
            nonlocal n
            if isinstance(value, str):
                value, k = self.apply(value)
                n += k
            elif isinstance(value, (int, float)) and not isinstance(value, bool) and abs(value) >= 10 ** 6:
                # as written in the file (4111111111111111.0 too), and its digits (4.111111111111111e+16)
                text = json.dumps(value)
                k = self.apply(text)[1] or self.apply(_digits(text.partition("e")[0]))[1]
                n += k
                value = None if k else value
            elif isinstance(value, list):
                value = [red(v) for v in value]
            elif isinstance(value, dict):
                value = {k: red(v) for k, v in value.items()}
            return value

        messages = None if record.messages is None else [
            {"role": m["role"], "content": red(m["content"])} for m in record.messages]
        return record.replace(
            messages=messages, prompt=red(record.prompt), response_text=red(record.response_text),
            model=red(record.model), sampling=red(record.sampling), redacted=record.redacted + n)
