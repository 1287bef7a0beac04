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
    """Examples, how they are laid out in rows (one or several documents per row), and which rows form a
    group (the unit of sampling: a row alone, or the rows of one record's sequences, kept together)."""

    examples: list[Example]
    rows: list[list[int]]
    groups: list[list[int]]
    stats: EncodeStats

    def group_counts(self) -> dict[str, list[int]]:
        """Per group: tokens, targets, sequences, 1 group, and the causal attention pairs its documents need
        (n(n+1)/2 each: the MFU numerator's attention term), so any rank can count a whole global batch
        without communicating."""
        if not hasattr(self, "_group_counts"):
            lengths = [[len(self.examples[i].input_ids) for i in row] for row in self.rows]
            targets = [sum(self.examples[i].num_targets for i in row) for row in self.rows]
            per_row = {
                "tokens": [sum(row) for row in lengths],
                "targets": targets,
                "sequences": [len(row) for row in lengths],
                "attention_pairs": [sum(n * (n + 1) // 2 for n in row) for row in lengths],
            }
            self._group_counts = {k: [sum(v[r] for r in g) for g in self.groups] for k, v in per_row.items()}
            self._group_counts["groups"] = [1] * len(self.groups)
        return self._group_counts

    def rows_of(self, groups: list[int]) -> list[list[int]]:
        """The rows of these groups, in order (a group's rows consecutive)."""
        return [self.rows[r] for g in groups for r in self.groups[g]]

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


def build_rows(
    records: list[Record], encoder: Any, data: DataSection, what: str, seed: int = 0, group_size: int = 1
) -> RowSet:
    """Encode and lay out rows. Sequences of one group (group_size > 1) get a row each and are never packed
    with others: they are compared with each other, not trained as independent documents."""
    examples, stats = encode_all(records, encoder, data.max_length, data.truncation, what, group_size)
    if group_size > 1:
        rows = single_rows(len(examples))
        groups = [list(range(g, g + group_size)) for g in range(0, len(rows), group_size)]
        return RowSet(examples, rows, groups, stats)
    lengths = [len(e.input_ids) for e in examples]
    rows = pack_rows(lengths, data.max_length, seed) if data.packing else single_rows(len(examples))
    return RowSet(examples, rows, [[r] for r in range(len(rows))], stats)


def build_datasets(
    data: DataSection, stage: str, encoder: Any, seed: int, group_size: int = 1
) -> tuple[RowSet, RowSet | None]:
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
    train = build_rows(train_records, encoder, data, "training data", seed, group_size)
    evaluation = (
        build_rows(eval_records, encoder, data, "evaluation data", seed, group_size) if eval_records else None
    )
    return train, evaluation
