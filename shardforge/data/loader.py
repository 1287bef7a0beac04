"""From the `data` config section to packed rows ready for the sampler: read, encode, truncate, pack."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardforge.config.schema import DataSection, DatasetSpec
from shardforge.data.dataset_info import resolve_entry
from shardforge.data.examples import EncodeStats, Example, encode_all
from shardforge.data.formats import Record, default_fields, detect_format, read_records
from shardforge.data.packing import pack_rows, single_rows
from shardforge.errors import DataError


@dataclass
class RowSet:
    """Examples and how they are grouped into rows (one or several documents per row)."""

    examples: list[Example]
    rows: list[list[int]]
    stats: EncodeStats

    def row_counts(self) -> tuple[list[int], list[int]]:
        """(tokens, targets) per row, so any rank can count a whole global batch without communicating."""
        if not hasattr(self, "_row_counts"):
            tokens = [sum(len(self.examples[i].input_ids) for i in row) for row in self.rows]
            targets = [sum(self.examples[i].num_targets for i in row) for row in self.rows]
            self._row_counts = (tokens, targets)
        return self._row_counts

    @property
    def num_targets(self) -> int:
        return sum(e.num_targets for e in self.examples)

    @property
    def num_tokens(self) -> int:
        return sum(len(e.input_ids) for e in self.examples)


def read_dataset(spec: DatasetSpec, stage: str) -> list[Record]:
    """Read one configured dataset (a file/folder path, or a named dataset_info.json entry) for `stage`."""
    if spec.name is not None:
        entry = resolve_entry(spec.name, spec.dataset_info or "", stage, spec.text_column)
        if spec.format is not None and spec.format != entry.format:
            raise DataError(
                f'dataset "{spec.name}": format {spec.format} conflicts with its dataset_info formatting '
                f"({entry.format}); drop format or make them agree"
            )
        return read_records(entry.path, entry.format, stage, entry.fields, spec.max_samples)
    path = Path(spec.path or "")
    fmt = spec.format or detect_format(path, spec.text_column)
    return read_records(path, fmt, stage, default_fields(fmt, spec.text_column), spec.max_samples)


def _read_all(specs: list[DatasetSpec], stage: str) -> list[Record]:
    records: list[Record] = []
    for spec in specs:
        records.extend(read_dataset(spec, stage))
    return records


def build_rows(records: list[Record], encoder: Any, data: DataSection, what: str, seed: int = 0) -> RowSet:
    examples, stats = encode_all(records, encoder, data.max_length, data.truncation, what)
    lengths = [len(e.input_ids) for e in examples]
    rows = pack_rows(lengths, data.max_length, seed) if data.packing else single_rows(len(examples))
    return RowSet(examples, rows, stats)


def build_datasets(data: DataSection, stage: str, encoder: Any, seed: int) -> tuple[RowSet, RowSet | None]:
    """Training rows and (optional) evaluation rows; `data.eval_fraction` holds out a seeded share of
    train."""
    train_records = _read_all(data.train, stage)
    eval_records = _read_all(data.eval, stage) if data.eval else []
    if data.eval_fraction > 0:
        order = list(range(len(train_records)))
        random.Random(seed).shuffle(order)
        held = set(order[: max(1, int(len(order) * data.eval_fraction))])
        if len(held) >= len(train_records):
            raise DataError(f"data.eval_fraction={data.eval_fraction} leaves no training record")
        eval_records += [r for i, r in enumerate(train_records) if i in held]
        train_records = [r for i, r in enumerate(train_records) if i not in held]
    train = build_rows(train_records, encoder, data, "training data", seed)
    evaluation = build_rows(eval_records, encoder, data, "evaluation data", seed) if eval_records else None
    return train, evaluation
