"""Documents from the user's own files: `data: {name: text, path: GLOB, format, field}`.

`path` is a glob (`~` expanded, `**` descends into sub-directories). One document is a non-blank
line of a txt file, the string under `field` of each JSON record of a jsonl file (one record per
line), or the string in column `field` of each row of a Parquet file. Files are read as streams
(line by line; Parquet in record batches) in the sorted order of their paths, so a corpus of any
size passes through in bounded memory. `check` finds the mistakes a user can make (a glob that
matches nothing, files of mixed or unknown formats, a missing field or column, a corpus with no
text) before anything runs, reading only the first records of each file.
"""

from __future__ import annotations

import glob
import json
import os
from pathlib import Path
from typing import Iterator

import pyarrow as pa
import pyarrow.parquet as pq

from ..errors import DataUnavailable
from .text import Corpus, require_text

FORMATS = ("txt", "jsonl", "parquet")
SUFFIXES = {".txt": "txt", ".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet"}
CHECK_RECORDS = 5  # JSON records of each file checked for the field before preparing
PARQUET_BATCH = 1000


def files(path: str) -> list[Path]:
    """The files the glob `data.path` matches, sorted."""
    found = sorted(Path(p) for p in glob.glob(os.path.expanduser(path), recursive=True))
    found = [p for p in found if p.is_file()]
    if not found:
        raise DataUnavailable(
            f"data.path = {path!r}: matches no files.\n"
            "  fix: give a glob of your corpus files, e.g. ~/corpus/*.jsonl, or ~/corpus/**/*.txt to include "
            "sub-directories")
    return found


def file_format(found: list[Path], path: str, given: str | None) -> str:
    """`data.format` if given, else the format every file's suffix names (.txt, .jsonl/.json, .parquet)."""
    if given:
        return given
    by_format: dict[str | None, list[Path]] = {}
    for f in found:
        by_format.setdefault(SUFFIXES.get(f.suffix.lower()), []).append(f)
    if None in by_format:
        f = by_format[None][0]
        raise DataUnavailable(
            f"data.format is not set and the suffix of {f} ({f.suffix or 'none'!r}) does not say its format.\n"
            f"  fix: set data.format to one of {', '.join(FORMATS)}, or narrow data.path = {path!r} to "
            f"files named {', '.join(SUFFIXES)}")
    if len(by_format) > 1:
        counts = ", ".join(f"{len(v)} {k}" for k, v in sorted(by_format.items()))
        raise DataUnavailable(
            f"data.path = {path!r}: matches files of several formats ({counts}); a corpus is read in one.\n"
            "  fix: narrow data.path to one kind of file, e.g. ~/corpus/*.jsonl, or set data.format if "
            "they all hold that format whatever their names")
    (fmt,) = by_format
    return fmt


def documents(found: list[Path], fmt: str, field: str) -> Iterator[str]:
    """Every non-blank document of the files, file after file."""
    read = {"txt": _txt, "jsonl": _jsonl, "parquet": _parquet}[fmt]
    for f in found:
        try:
            yield from read(f, field)
        except UnicodeDecodeError as e:
            raise DataUnavailable(f"data.format = {fmt!r}: {f} is not UTF-8 text ({e.reason} at byte {e.start}).\n"
                                  "  fix: convert it to UTF-8, or leave it out of data.path") from None


def _txt(file: Path, field: str) -> Iterator[str]:
    with open(file, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                yield line.rstrip("\r\n")


def _jsonl(file: Path, field: str) -> Iterator[str]:
    with open(file, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataUnavailable(
                    f"data.format = 'jsonl': line {n} of {file} is not JSON ({e.msg}).\n"
                    "  fix: write one JSON object per line, or set data.format: txt to read the lines as "
                    "plain text") from None
            value = _field_of(record, field, f"line {n} of {file}")
            if value.strip():
                yield value


def _field_of(record, field: str, where: str) -> str:
    if not isinstance(record, dict):
        raise DataUnavailable(f"data.format = 'jsonl': {where} is a JSON {type(record).__name__}, not an object.\n"
                              f"  fix: write one object per line, e.g. {{\"{field}\": \"...\"}}")
    if field not in record or not isinstance(record[field], str):
        strings = [k for k, v in record.items() if isinstance(v, str)]
        problem = (f"has no key {field!r} (its keys: {', '.join(map(repr, record)) or 'none'})" if field not in record
                   else f"holds a value of type {type(record[field]).__name__} under {field!r}, not a string")
        raise DataUnavailable(f"data.field = {field!r}: the record at {where} {problem}.\n"
                              "  fix: set data.field to the key that holds the document's text"
                              + (f", e.g. data.field: {strings[0]}" if strings else ""))
    return record[field]


def _parquet(file: Path, field: str) -> Iterator[str]:
    pf = _parquet_file(file, field)
    for batch in pf.iter_batches(batch_size=PARQUET_BATCH, columns=[field]):
        for value in batch.column(0).to_pylist():
            if value and value.strip():
                yield value


def _parquet_file(file: Path, field: str) -> pq.ParquetFile:
    try:
        pf = pq.ParquetFile(file)
    except (pa.ArrowInvalid, OSError) as e:
        raise DataUnavailable(f"data.format = 'parquet': {file} is not a Parquet file ({e}).\n"
                              "  fix: leave it out of data.path, or set data.format to its format") from None
    schema = pf.schema_arrow
    if field not in schema.names:
        raise DataUnavailable(
            f"data.field = {field!r}: {file} has no column {field!r} (its columns: {', '.join(schema.names)}).\n"
            "  fix: set data.field to the column that holds the documents' text")
    kind = schema.field(field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise DataUnavailable(f"data.field = {field!r}: column {field!r} of {file} holds {kind}, not strings.\n"
                              "  fix: set data.field to a column of strings")
    return pf


def check(spec) -> None:
    """The `text` set's files are there, in one known format, with `field` in them, and hold text."""
    found = files(spec.path)
    fmt = file_format(found, spec.path, spec.format)
    for f in found:
        if fmt == "parquet":
            _parquet_file(f, spec.field)
        elif fmt == "jsonl":
            for _ in zip(range(CHECK_RECORDS), _jsonl(f, spec.field)):
                pass
    require_text(documents(found, fmt, spec.field), f"data.path = {spec.path!r}", "the corpus",
                 "give files with text in them: txt one document per line, jsonl one JSON object per line with "
                 "the text under data.field, parquet a string column data.field")


def corpus(spec, tokenizers: Path, key: str) -> Corpus:
    """The `text` set: the user's files, validated on rows held out by data.val_fraction (default 5%)."""
    found = files(spec.path)
    fmt = file_format(found, spec.path, spec.format)
    return Corpus(train=lambda: documents(found, fmt, spec.field), bpe_file=tokenizers / f"text-{key}.json")
