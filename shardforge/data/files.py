"""Data files -> (source, decoded object) rows: JSONL, a JSON array, Parquet and plain .txt (a document per
line), a file or a folder of them. JSONL, .txt and Parquet files can also be read from a position
(`iter_from`), which is how a streamed corpus resumes. A row's source ("file:line", "file:row N" or
"file:record N (line L)") starts every error about it."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from shardforge.errors import DataError

SUFFIXES = (".jsonl", ".json", ".parquet", ".txt")  # .txt: plain text, one document per non-empty line
RawRow = tuple[str, Any]  # (source, decoded object)


def data_files(path: Path, fmt: str | None = None) -> list[Path]:
    """The data files at a path: the file itself, or a folder's data files in name order (its .txt files
    only for format text, so notes beside JSON data are not read as records; unset: if nothing else)."""
    if not path.exists():
        raise DataError(f"dataset file not found: {path} (resolved to {path.resolve()})")
    if not path.is_dir():
        return [path]
    found = sorted(
        p
        for p in path.iterdir()
        if p.is_file()
        and p.suffix.lower() in SUFFIXES
        and not p.name.startswith(".")
        and p.name != "dataset_info.json"
    )
    structured = [p for p in found if p.suffix.lower() != ".txt"]
    files = found if fmt == "text" or (fmt is None and not structured) else structured
    if not files:
        raise DataError(f"{path}: folder has no data files (supported: {', '.join(SUFFIXES)})")
    return files


def iter_raw(path: Path, fmt: str | None = None) -> Iterator[RawRow]:
    """Yield (source, decoded object) for every record of a file, or of every data file in a folder."""
    for file in data_files(path, fmt):
        if file.suffix.lower() == ".json":
            yield from _iter_json(file)
        else:
            for src, obj, _ in iter_from(file, (0, 1)):
                yield src, obj


FilePosition = tuple[int, int]  # (byte offset, line number) of a JSONL/.txt record; (row, 0) in Parquet


def iter_from(path: Path, start: FilePosition) -> Iterator[tuple[str, Any, FilePosition]]:
    """(source, decoded object, position of the next record) for the records of a JSONL, .txt or Parquet file
    from `start` on: a streamed corpus resumes by seeking, without reading what came before."""
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".txt"):
        return _iter_lines(path, start, suffix == ".jsonl")
    if suffix == ".parquet":
        return _iter_parquet(path, start[0])
    if suffix == ".json":
        raise DataError(
            f"{path}: a .json array cannot be read from a position (streamed); convert it to .jsonl, one "
            f"object per line"
        )
    raise DataError(
        f"{path}: unsupported file type {suffix or '(no extension)'!r}; "
        f"supported: {', '.join(SUFFIXES)} (or a folder of them)"
    )


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text (byte {e.start}); save the file as UTF-8") from None


def _iter_lines(path: Path, start: FilePosition, json_lines: bool) -> Iterator[tuple[str, Any, FilePosition]]:
    """JSONL objects, or .txt lines (documents, without the line break), from a byte offset on."""
    offset, lineno = start
    with path.open("rb") as fh:  # bytes, so lines split on "\n" only and a bad byte names its line
        fh.seek(offset)
        for raw in fh:
            offset += len(raw)
            try:
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
            except UnicodeDecodeError as e:
                raise DataError(
                    f"{path}:{lineno}:{e.start + 1}: not UTF-8 text; save the file as UTF-8"
                ) from None
            if line.strip():
                obj = _decode_line(line, path, lineno) if json_lines else line.rstrip("\r\n")
                yield f"{path}:{lineno}", obj, (offset, lineno + 1)
            lineno += 1


def _decode_line(line: str, path: Path, lineno: int) -> Any:
    try:
        return json.loads(line)
    except json.JSONDecodeError as e:
        hint = "; this looks like a JSON array, name the file .json" if line.strip() == "[" else ""
        raise DataError(
            f"{path}:{lineno}:{e.colno}: invalid JSON ({e.msg}); expected one object per line{hint}"
        ) from None


_WS = re.compile(r"[ \t\n\r]*")


def _skip_ws(text: str, pos: int) -> int:
    match = _WS.match(text, pos)
    return match.end() if match else pos


def _iter_json(path: Path) -> Iterator[RawRow]:
    """Decode a top-level array element by element, so each record knows the line it starts on."""
    text = _read_text(path)
    decoder = json.JSONDecoder()

    def fail(pos: int, what: str) -> DataError:
        line = text.count("\n", 0, pos) + 1
        return DataError(f"{path}:{line}:{pos - text.rfind(chr(10), 0, pos)}: {what}")

    pos = _skip_ws(text, 0)
    if pos == len(text):
        return  # an empty file has no records
    if text[pos] != "[":
        raise fail(pos, "expected a top-level JSON array of records (for one object per line, use .jsonl)")
    pos = _skip_ws(text, pos + 1)
    line, counted, index = 1, 0, 0
    more = text[pos : pos + 1] != "]"
    while more:
        try:
            obj, end = decoder.raw_decode(text, pos)  # after a trailing comma this fails on "]", as it should
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{e.lineno}:{e.colno}: invalid JSON ({e.msg})") from None
        line, counted = line + text.count("\n", counted, pos), pos
        yield f"{path}:record {index} (line {line})", obj
        index += 1
        pos = _skip_ws(text, end)
        more = text[pos : pos + 1] == ","
        if more:
            pos = _skip_ws(text, pos + 1)
        elif text[pos : pos + 1] != "]":
            raise fail(pos, "invalid JSON (expected ',' or ']' after a record)")
    pos = _skip_ws(text, pos + 1)
    if pos < len(text):
        raise fail(pos, "invalid JSON (extra content after the top-level array)")


def _iter_parquet(path: Path, start: int = 0) -> Iterator[tuple[str, Any, FilePosition]]:
    """Rows from row `start` on, reading only the row groups from the one that holds it."""
    from shardforge.extras import require

    (pa,) = require("parquet", f"reading the Parquet file {path}", "pyarrow")
    import pyarrow.parquet as pq

    try:
        file = pq.ParquetFile(path)
        sizes = [file.metadata.row_group(i).num_rows for i in range(file.num_row_groups)]
        first, row = 0, 0
        while first < len(sizes) and row + sizes[first] <= start:
            row += sizes[first]
            first += 1
        batches = file.iter_batches(batch_size=1024, row_groups=range(first, len(sizes)))
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{path}: cannot read Parquet file ({e})") from None
    for batch in batches:
        for obj in batch.to_pylist():
            if row >= start:
                yield f"{path}:row {row}", obj, (row + 1, 0)
            row += 1
