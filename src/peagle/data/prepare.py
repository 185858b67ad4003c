"""The data-preparation stage: sources -> rendered, masked, de-duplicated, split parquet shards.

Contract of :func:`run_prepare`:

* rows are read in source order (no shuffling: the trainer shuffles); each row is parsed
  (:mod:`.rows`), rendered with the target's chat template (:mod:`.chat`) or passed through when
  pre-tokenised, truncated to ``max_length``, de-duplicated and assigned to a split;
* a row that cannot be used never stops the stage: it is counted under a reason code, and the first
  ``max_rejected_listed`` are listed with their source and index;
* bytes of a .json/.jsonl/.parquet source that are not UTF-8 become U+FFFD, or reject their row
  (``invalid_utf8``); each source's manifest entry counts them (``invalid_utf8``: characters, rows);
* the stage fails with :class:`PrepareError` (naming the source) when a source cannot be read or has
  no rows, when a source rejects more than ``max_rejected_fraction`` of its rows, or when no
  training row is left; files it wrote are removed again and no manifest is written;
* counts satisfy ``read == accepted + rejected`` (rows) and ``kept == train + validation`` (rows of
  the output); an accepted conversation may give several rows (``rows_per``), some of which may be
  dropped as too long or as duplicates.

Split: a conversation goes to validation when ``sha256(seed, id) < validation_fraction``, where id
is ``<source label>/<row id or row index>``; it depends on nothing else, so it is stable across
runs, orderings and other rows. Every row of one conversation lands in the same split.

The embedded ``sharegpt`` source never hands over its evaluation hold-out (:mod:`.heldout`); each
source's manifest entry counts the conversations it withheld (``held_out``).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .chat import ChatRenderer, tokenizer_fingerprint
from .errors import (INVALID_JSON, INVALID_UTF8, TOO_FEW_SUPERVISED, TOO_LONG, PrepareError, RowRejected,
                     TemplateTimeout)
from .output import PreparedHeader, PreparedWriter, open_writer
from .rows import Conversation, PreparedRow, parse_row
from .settings import PrepareSettings
from .sources import InvalidUtf8, Source, Unparsable, resolve_sources

log = logging.getLogger(__name__)


@dataclass
class PrepareResult:
    output_dir: str  # as given: a local path or a storage URI
    manifest: dict[str, Any]

    @property
    def counts(self) -> dict[str, int]:
        return self.manifest["counts"]

    @property
    def header(self) -> PreparedHeader:
        """The published manifest, typed as readers see it (:meth:`PreparedData.open`)."""
        return PreparedHeader.from_metadata(self.manifest, self.output_dir)


def split_of(key: str, seed: int, validation_fraction: float) -> str:
    """Deterministic split of a conversation id (see the module docstring)."""
    if validation_fraction <= 0:
        return "train"
    digest = hashlib.sha256(f"{seed}\0{key}".encode()).digest()
    return "validation" if int.from_bytes(digest[:8], "big") / 2**64 < validation_fraction else "train"


def _target_vocab_size(target: Path, tokenizer_len: int) -> int:
    """Ids a pre-tokenised row may use: the model's embedding rows when config.json says, else the tokenizer."""
    cfg = target / "config.json"
    if cfg.is_file():
        try:
            v = json.loads(cfg.read_text()).get("vocab_size")
            if isinstance(v, int) and v > 0:
                return max(v, tokenizer_len)
        except (ValueError, AttributeError):
            pass
    return tokenizer_len


class _Stage:
    """Holds the running state of one prepare run; :meth:`run` drives it."""

    def __init__(self, settings: PrepareSettings, renderer: ChatRenderer, vocab_size: int, writer: PreparedWriter):
        self.s = settings
        self.renderer = renderer
        self.vocab_size = vocab_size
        self.writer = writer
        self.counts: Counter[str] = Counter()
        self.reasons: Counter[str] = Counter()
        self.rejected: list[dict[str, Any]] = []
        self.seen_hashes: set[bytes] = set()
        self.seen_ids: set[str] = set()  # conversation-level ids handed out
        self.kept_ids: set[str] = set()  # sample ids written
        self.per_source: list[dict[str, Any]] = []

    # -- rows -> samples ---------------------------------------------------------------------------

    def _base_id(self, source: Source, index: int, row_id: str | None) -> str:
        base = f"{source.label}/{row_id}" if row_id else f"{source.label}/row{index}"
        # ShareGPT V3 repeats some ids; ids must stay unique (hidden-state extraction keys on them)
        candidate, n = base, 1
        while candidate in self.seen_ids:
            candidate = f"{base}@{index}" if n == 1 else f"{base}@{index}~{n}"
            n += 1
        self.seen_ids.add(candidate)
        return candidate

    def _fit(self, ids: list[int], mask: list[int], cut: bool = False) -> tuple[np.ndarray, np.ndarray, bool]:
        """Apply max_length / min_supervised_tokens; raise RowRejected when the row cannot be kept.

        ``cut``: the row's text was cut before tokenising, so it has more tokens than ``ids``.
        """
        truncated = len(ids) > self.s.max_length
        if truncated:
            if self.s.overlong == "reject":
                more = "more than " if cut else ""
                raise RowRejected(TOO_LONG, f"{more}{len(ids)} tokens > max_length {self.s.max_length}")
            ids, mask = ids[: self.s.max_length], mask[: self.s.max_length]
        arr_mask = np.asarray(mask, dtype=np.int8)
        supervised = int(arr_mask.sum())
        if supervised == 0 and truncated:
            raise RowRejected(TOO_LONG, f"no supervised token within the first {self.s.max_length} tokens")
        if supervised < self.s.min_supervised_tokens:
            raise RowRejected(TOO_FEW_SUPERVISED,
                              f"{supervised} supervised tokens < min_supervised_tokens {self.s.min_supervised_tokens}")
        return np.asarray(ids, dtype=np.int32), arr_mask, truncated

    def samples_for(self, source: Source, index: int, raw: Any) -> list[PreparedRow]:
        """Samples of one input row, or RowRejected."""
        if isinstance(raw, Unparsable):
            raise RowRejected(INVALID_JSON, raw.error)
        if isinstance(raw, InvalidUtf8):
            raise RowRejected(INVALID_UTF8, f"{raw.chars} undecodable byte sequence(s) (not UTF-8) "
                                              "(prepare.invalid_utf8=replace keeps such rows, with U+FFFD)")
        record = parse_row(raw, self.vocab_size)
        base = self._base_id(source, index, record.row_id)
        per_turn, skipped_turns = False, 0
        if isinstance(record, Conversation):
            rendered = self.renderer.render(record.messages, self.s.rows_per, self.s.max_length)
            candidates = [(r.input_ids, r.loss_mask, r.turn, r.cut) for r in rendered.rows]
            per_turn = rendered.per_turn
            # turns past the length limit: separate rows lost when per turn, else part of the truncation
            skipped_turns = rendered.skipped_turns if per_turn else 0
        else:
            candidates = [(record.input_ids, record.loss_mask, None, False)]
        samples, first_problem = [], None
        for ids, mask, turn, cut in candidates:
            try:
                arr_ids, arr_mask, truncated = self._fit(ids, mask, cut)
            except RowRejected as exc:
                first_problem = first_problem or exc
                continue
            self.counts["truncated"] += truncated
            sid = base if turn is None else f"{base}#t{turn}"
            samples.append(PreparedRow(sid, base, source.label, arr_ids, arr_mask))
        if not samples:
            raise first_problem  # type: ignore[misc]  # candidates is never empty
        self.counts["turn_rows_dropped"] += len(candidates) - len(samples) + skipped_turns
        if isinstance(record, Conversation):
            self.counts["leading_assistant_turns_dropped"] += record.leading_assistant_dropped
            self.counts["conversations_split_into_turns"] += per_turn and self.s.rows_per == "auto"
        return samples

    # -- bookkeeping ---------------------------------------------------------------------------------

    def reject(self, source: Source, index: int, exc: RowRejected) -> None:
        self.counts["rejected"] += 1
        self.reasons[exc.reason] += 1
        if len(self.rejected) < self.s.max_rejected_listed:
            self.rejected.append({"source": source.label, "index": index, "reason": exc.reason, "detail": exc.detail})

    def keep(self, sample: PreparedRow) -> bool:
        """Dedup, split and write one sample; False when it was a duplicate."""
        if self.s.dedup:
            h = hashlib.sha256(sample.input_ids.tobytes() + b"\0" + sample.loss_mask.tobytes()).digest()
            if h in self.seen_hashes:
                self.counts["deduplicated"] += 1
                return False
            self.seen_hashes.add(h)
        while sample.sample_id in self.kept_ids:  # only if a row id itself looks like "<id>#t<k>"
            sample.sample_id += "~"
        self.kept_ids.add(sample.sample_id)
        split = split_of(sample.split_key, self.s.seed, self.s.validation_fraction)
        self.counts["kept"] += 1
        self.counts[split] += 1
        self.writer.add(split, sample)
        return True

    def report(self) -> dict[str, Any]:
        keys = ("read", "accepted", "rejected", "kept", "deduplicated", "train", "validation", "truncated",
                "turn_rows_dropped", "conversations_split_into_turns", "leading_assistant_turns_dropped")
        return {"counts": {k: int(self.counts[k]) for k in keys},
                "rejected_by_reason": dict(self.reasons.most_common())}

    # -- the run -------------------------------------------------------------------------------------

    def _check_source(self, source: Source, read: int, rejected: int, reasons: Counter[str]) -> None:
        if read == 0:
            raise PrepareError(f"source {source.location} has no rows", self.report())
        share = rejected / read
        if share > self.s.max_rejected_fraction:
            top = ", ".join(f"{r}: {n}" for r, n in reasons.most_common(5))
            example = next((r for r in self.rejected if r["source"] == source.label), None)
            hint = f"; e.g. row {example['index']}: {example['reason']}: {example['detail']}" if example else ""
            raise PrepareError(
                f"source {source.location}: {rejected} of {read} rows rejected ({share:.0%} > max_rejected_fraction "
                f"{self.s.max_rejected_fraction:.0%}); reasons: {top}{hint}",
                self.report(),
            )

    def run(self, sources: list[Source]) -> None:
        started = time.monotonic()
        done = False
        for source in sources:
            entry = {"spec": source.spec, "label": source.label, "location": source.location}
            self.per_source.append(entry)
            if done:
                entry["notes"] = ["not read: max_samples reached"]
                continue
            read = rejected = kept = 0
            reasons: Counter[str] = Counter()
            for index, raw in source.iter_rows(self.s.max_rows_per_source, self.s.invalid_utf8):
                read += 1
                self.counts["read"] += 1
                try:
                    samples = self.samples_for(source, index, raw)
                except RowRejected as exc:
                    rejected += 1
                    reasons[exc.reason] += 1
                    self.reject(source, index, exc)
                    continue
                except TemplateTimeout as exc:
                    raise TemplateTimeout(f"{exc} (at row {index} of {source.location})", self.report()) from None
                self.counts["accepted"] += 1
                for sample in samples:
                    kept += self.keep(sample)
                    if self.s.max_samples is not None and self.counts["kept"] >= self.s.max_samples:
                        done = True
                        break
                if done:
                    source.notes.append(f"stopped: max_samples={self.s.max_samples} reached")
                    break
                if self.counts["read"] % 1000 == 0:
                    log.info("prepare: %d rows read, %d kept, %d rejected (%.0f s)", self.counts["read"],
                             self.counts["kept"], self.counts["rejected"], time.monotonic() - started)
            if source.invalid_utf8_rows:
                log.warning("%s: %d rows hold %d byte sequence(s) that are not UTF-8 (%s)", source.location,
                            source.invalid_utf8_rows, source.invalid_utf8_chars,
                            "rejected" if self.s.invalid_utf8 == "reject" else "replaced by U+FFFD")
            entry.update(read=read, rejected=rejected, kept=kept, rejected_by_reason=dict(reasons),
                         invalid_utf8={"chars": source.invalid_utf8_chars, "rows": source.invalid_utf8_rows},
                         held_out=source.held_out_rows, notes=source.notes)
            self._check_source(source, read, rejected, reasons)
        names = ", ".join(s.location for s in sources)
        if self.counts["kept"] == 0:
            raise PrepareError(
                f"no usable rows in {names}: {self.counts['read']} read, {self.counts['rejected']} rejected, "
                f"{self.counts['deduplicated']} duplicates", self.report()
            )
        if self.counts["train"] == 0:
            raise PrepareError(
                f"all {self.counts['kept']} rows from {names} fell into the validation split "
                f"(validation_fraction={self.s.validation_fraction}); add data or lower it", self.report()
            )


def run_prepare(
    settings: PrepareSettings,
    target: str | os.PathLike,
    output_dir: str | os.PathLike,
    *,
    trust_remote_code: bool = False,
) -> PrepareResult:
    """Prepare training data for the draft of ``target`` into ``output_dir``; see the module docstring.

    ``target`` is a local model directory (its tokenizer and chat template are used; nothing is
    downloaded). ``output_dir`` is a local directory or a storage URI; the result is published there
    (:mod:`.output`) with the returned manifest as its metadata.
    """
    target = Path(target)
    renderer = ChatRenderer.from_target(target, trust_remote_code, settings.template_kwargs(),
                                        settings.template_time_limit_s)
    tokenizer_sha256 = tokenizer_fingerprint(target)
    vocab_size = _target_vocab_size(target, renderer.vocab_size())
    sources = resolve_sources(settings.sources)  # fail on a missing source before touching the output
    writer = open_writer(output_dir, settings.shard_rows)
    stage = _Stage(settings, renderer, vocab_size, writer)
    with writer:  # a failure removes what was written: no partial dataset, no manifest
        with renderer.time_limits():
            stage.run(sources)
        manifest = writer.publish({
            "target": {
                "path": str(target),
                "tokenizer_sha256": tokenizer_sha256,
                "chat_template_sha256": renderer.template_sha256,
                "vocab_size": vocab_size,
            },
            "settings": settings.model_dump(mode="json"),
            "sources": stage.per_source,
            **stage.report(),
            "rejected": stage.rejected,
            "rejected_listed": len(stage.rejected),
        })
    log.info("prepare: %s", manifest["counts"])
    return PrepareResult(str(output_dir), manifest)
