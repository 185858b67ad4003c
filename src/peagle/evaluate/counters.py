"""vLLM's speculative-decoding counters: one normaliser for both ways of reading them.

vLLM counts, per engine (labels ``model_name``, ``engine``):

=============================================== ==========================================
``vllm:spec_decode_num_drafts``                  verification steps that carried a draft
``vllm:spec_decode_num_draft_tokens``            proposed tokens (K per draft)
``vllm:spec_decode_num_accepted_tokens``         accepted draft tokens
``vllm:spec_decode_num_accepted_tokens_per_pos`` drafts whose token at ``position`` i (0-based)
                                                 was accepted; one series per position 0..K-1
=============================================== ==========================================

They reach us in two shapes, both turned into :class:`MetricSample` rows and then into one
:class:`SpecDecodeCounts` by :func:`counts_from_samples`:

* ``LLM.get_metrics()`` objects (offline API): ``Counter(name, labels, value)`` and, for the
  per-position counter, ``Vector(name, labels, values)``; names carry no ``_total`` suffix.
  :func:`samples_from_vllm_metrics`.
* Prometheus exposition text from a server's ``/metrics`` (``vllm serve``, a KServe
  InferenceService): counters end in ``_total``, the per-position counter is one series per
  ``position`` label, and prometheus_client adds ``*_created`` timestamps.
  :func:`parse_prometheus_text`.

Counts are summed over every label set (data-parallel engines, several ``model_name`` values
unless one is selected). Counters only grow, so a measurement over a workload is the difference of
two snapshots (:meth:`SpecDecodeCounts.minus`), which also removes warm-up traffic and, on a shared
server, earlier requests.

Derived figures (docs/peagle-format.md §4, the same formulas as vLLM's own log line):
acceptance length AL = 1 + accepted / drafts (the +1 is the target's bonus token); per-position
acceptance a_i = accepted_at_pos[i] / drafts, the *unconditional* probability that the first i+1
draft tokens were all accepted (hence non-increasing); Σ_i accepted_at_pos[i] = accepted.
"""
from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

DRAFTS = "vllm:spec_decode_num_drafts"
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"
SCALAR_COUNTERS = {DRAFTS: "drafts", DRAFT_TOKENS: "draft_tokens", ACCEPTED: "accepted_tokens"}
POSITION_LABEL = "position"


class CounterError(ValueError):
    """Counter text that cannot be parsed, or snapshots that cannot be differenced."""


@dataclass(frozen=True)
class MetricSample:
    """One sample of one series: the metric name without ``_total``, its labels and its value."""

    name: str
    labels: dict[str, str]
    value: float


@dataclass
class SpecDecodeCounts:
    """Spec-decode counters summed over label sets (a snapshot, or the difference of two)."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    # ---- derived figures (None when there was no draft to measure)

    @property
    def num_positions(self) -> int:
        """K as vLLM saw it: the length of the per-position vector."""
        return len(self.accepted_per_pos)

    @property
    def acceptance_length(self) -> float | None:
        """Mean tokens per verification step: 1 + accepted / drafts."""
        return 1.0 + self.accepted_tokens / self.drafts if self.drafts else None

    @property
    def per_position_acceptance(self) -> list[float]:
        """a_i = accepted_at_pos[i] / drafts: P(the first i+1 draft tokens were accepted)."""
        return [a / self.drafts for a in self.accepted_per_pos] if self.drafts else []

    @property
    def conditional_acceptance(self) -> list[float | None]:
        """P(position i accepted | positions < i accepted) = a_i / a_{i-1} (a_{-1} = drafts)."""
        out: list[float | None] = []
        prev = self.drafts
        for a in self.accepted_per_pos:
            out.append(a / prev if prev else None)
            prev = a
        return out

    @property
    def draft_acceptance_rate(self) -> float | None:
        """accepted / proposed draft tokens."""
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else None

    # ---- arithmetic

    def minus(self, before: "SpecDecodeCounts") -> "SpecDecodeCounts":
        """``self - before`` for two snapshots of the same server; refuses counters that went back."""
        k = max(self.num_positions, before.num_positions)
        after_pos = self.accepted_per_pos + [0] * (k - self.num_positions)
        before_pos = before.accepted_per_pos + [0] * (k - before.num_positions)
        out = SpecDecodeCounts(self.drafts - before.drafts, self.draft_tokens - before.draft_tokens,
                               self.accepted_tokens - before.accepted_tokens,
                               [a - b for a, b in zip(after_pos, before_pos)])
        if min(out.drafts, out.draft_tokens, out.accepted_tokens, *out.accepted_per_pos, 0) < 0:
            raise CounterError(f"spec-decode counters went backwards between snapshots ({before} -> {self}): "
                               "the server restarted or another engine's counters were mixed in")
        if before.num_positions and self.num_positions and before.num_positions != self.num_positions:
            raise CounterError(f"the per-position counter changed length between snapshots "
                               f"({before.num_positions} -> {self.num_positions}): a different K was served")
        return out

    def plus(self, other: "SpecDecodeCounts") -> "SpecDecodeCounts":
        k = max(self.num_positions, other.num_positions)
        a = self.accepted_per_pos + [0] * (k - self.num_positions)
        b = other.accepted_per_pos + [0] * (k - other.num_positions)
        return SpecDecodeCounts(self.drafts + other.drafts, self.draft_tokens + other.draft_tokens,
                                self.accepted_tokens + other.accepted_tokens, [x + y for x, y in zip(a, b)])

    def problems(self) -> list[str]:
        """Invariants vLLM's counters satisfy; a non-empty list means the numbers are not trustworthy."""
        out = []
        if self.accepted_per_pos and sum(self.accepted_per_pos) != self.accepted_tokens:
            out.append(f"per-position counts sum to {sum(self.accepted_per_pos)}, accepted is {self.accepted_tokens}")
        if any(b > a for a, b in zip(self.accepted_per_pos, self.accepted_per_pos[1:])):
            out.append(f"per-position counts increase with the position: {self.accepted_per_pos}")
        if self.accepted_per_pos and self.accepted_per_pos[0] > self.drafts:
            out.append(f"position 0 accepted {self.accepted_per_pos[0]} times in {self.drafts} drafts")
        if self.accepted_tokens > self.draft_tokens:
            out.append(f"accepted {self.accepted_tokens} of {self.draft_tokens} proposed tokens")
        return out

    # ---- (de)serialisation

    def as_dict(self) -> dict[str, Any]:
        """The plain counter dict (the keys :func:`.vllm_job.spec_decode_counts` always returned)."""
        return {"drafts": self.drafts, "draft_tokens": self.draft_tokens, "accepted_tokens": self.accepted_tokens,
                "accepted_per_pos": list(self.accepted_per_pos)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "SpecDecodeCounts":
        return cls(int(d.get("drafts", 0)), int(d.get("draft_tokens", 0)), int(d.get("accepted_tokens", 0)),
                   [int(x) for x in d.get("accepted_per_pos", [])])

    def figures(self) -> dict[str, Any]:
        """Counts plus the derived figures, as stored in report.json."""
        return {"acceptance_length": self.acceptance_length,
                "per_position_acceptance": self.per_position_acceptance,
                "conditional_acceptance": self.conditional_acceptance,
                "draft_acceptance_rate": self.draft_acceptance_rate,
                "counts": self.as_dict()}


# ----------------------------------------------------------------------------------------------
# The normaliser


def counts_from_samples(samples: Iterable[MetricSample], model_name: str | None = None) -> SpecDecodeCounts:
    """Sum the spec-decode series of ``samples`` over all label sets.

    ``model_name`` keeps only series whose ``model_name`` label equals it (series without that
    label are kept): one server may host several models.
    """
    out = SpecDecodeCounts()
    per_pos: dict[int, int] = {}
    for s in samples:
        if model_name is not None and s.labels.get("model_name", model_name) != model_name:
            continue
        if s.name in SCALAR_COUNTERS:
            attr = SCALAR_COUNTERS[s.name]
            setattr(out, attr, getattr(out, attr) + _as_count(s))
        elif s.name == ACCEPTED_PER_POS:
            if POSITION_LABEL not in s.labels:
                raise CounterError(f"{ACCEPTED_PER_POS} sample without a '{POSITION_LABEL}' label: {s.labels}")
            pos = int(s.labels[POSITION_LABEL])
            per_pos[pos] = per_pos.get(pos, 0) + _as_count(s)
    if per_pos:
        out.accepted_per_pos = [per_pos.get(i, 0) for i in range(max(per_pos) + 1)]
    return out


def _as_count(s: MetricSample) -> int:
    if not math.isfinite(s.value) or s.value < 0:
        raise CounterError(f"counter {s.name}{s.labels} has value {s.value}")
    return int(round(s.value))


def samples_from_vllm_metrics(metrics: Iterable[Any]) -> list[MetricSample]:
    """``LLM.get_metrics()`` objects -> samples; a ``Vector`` becomes one sample per position."""
    out = []
    for m in metrics:
        name = str(getattr(m, "name", "")).removesuffix("_total")
        labels = {str(k): str(v) for k, v in (getattr(m, "labels", None) or {}).items()}
        if hasattr(m, "values") and not hasattr(m, "value"):  # vllm.v1.metrics.reader.Vector
            for i, v in enumerate(m.values):
                out.append(MetricSample(name, {**labels, POSITION_LABEL: str(i)}, float(v)))
        elif hasattr(m, "value"):
            out.append(MetricSample(name, labels, float(m.value)))
    return out


def counts_from_vllm_metrics(metrics: Iterable[Any], model_name: str | None = None) -> SpecDecodeCounts:
    return counts_from_samples(samples_from_vllm_metrics(metrics), model_name)


def counts_from_prometheus_text(text: str, model_name: str | None = None) -> SpecDecodeCounts:
    return counts_from_samples(parse_prometheus_text(text), model_name)


# ----------------------------------------------------------------------------------------------
# Prometheus / OpenMetrics text exposition


def parse_prometheus_text(text: str) -> list[MetricSample]:
    """Samples of a text exposition (Prometheus 0.0.4 or OpenMetrics).

    Comment lines (``# HELP``, ``# TYPE``, ``# EOF``) and ``*_created`` / ``*_bucket`` /
    ``*_sum`` / ``*_count`` histogram-or-timestamp samples are kept out: only plain and ``_total``
    samples are returned, the latter under the name without the suffix.
    """
    out = []
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        try:
            name, labels, rest = _split_sample(line)
            value = float(rest.split()[0])
        except (ValueError, IndexError) as exc:
            raise CounterError(f"line {lineno} of the metrics text is not a Prometheus sample: {raw!r} ({exc})") from None
        if name.endswith(("_created", "_bucket", "_sum", "_count")):
            continue
        out.append(MetricSample(name.removesuffix("_total"), labels, value))
    return out


def _split_sample(line: str) -> tuple[str, dict[str, str], str]:
    """'name{a="x",b="y"} 1 1700000000' -> ('name', {'a': 'x', 'b': 'y'}, '1 1700000000')."""
    brace = line.find("{")
    space = line.find(" ")
    if brace == -1 or (space != -1 and space < brace):
        if space == -1:
            raise ValueError("no value")
        return line[:space], {}, line[space + 1:].strip()
    name = line[:brace].strip()
    labels: dict[str, str] = {}
    i = brace + 1
    n = len(line)
    while True:
        while i < n and line[i] in " ,":
            i += 1
        if i >= n:
            raise ValueError("unterminated label set")
        if line[i] == "}":
            i += 1
            break
        eq = line.find("=", i)
        if eq == -1:
            raise ValueError("label without '='")
        key = line[i:eq].strip()
        i = eq + 1
        if i >= n or line[i] != '"':
            raise ValueError(f"label {key} value is not quoted")
        i += 1
        chars = []
        while True:
            if i >= n:
                raise ValueError(f"unterminated value of label {key}")
            c = line[i]
            if c == "\\" and i + 1 < n:
                nxt = line[i + 1]
                chars.append({"n": "\n", "\\": "\\", '"': '"'}.get(nxt, "\\" + nxt))
                i += 2
                continue
            if c == '"':
                i += 1
                break
            chars.append(c)
            i += 1
        labels[key] = "".join(chars)
    if not name:
        raise ValueError("empty metric name")
    return name, labels, line[i:].strip()
