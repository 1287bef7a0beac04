"""From the `data` config section to packed rows ready for the sampler: read, encode, truncate, pack."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from shardforge.config.data_schema import DataSection, DatasetSpec
from shardforge.data.cache import DatasetCache, Splits, cache_key, file_fingerprint
from shardforge.data.dataset_info import resolve_entry
from shardforge.data.encode import encode_all
from shardforge.data.examples import EncodeStats
from shardforge.data.formats import FieldMap, Reading, Record, default_fields, detect_format, read_records
from shardforge.data.mixing import interleaved, split_order
from shardforge.data.packing import Rows, pack_rows, single_rows
from shardforge.data.store import ExampleStore
from shardforge.data.truncate import pretraining_blocks
from shardforge.errors import DataError


@dataclass
class RowSet:
    """Encoded examples (flat arrays, see data/store.py), how they are laid out in rows (one or several
    documents per row, as index arrays), and the groups: the unit of sampling, `group_size` consecutive rows
    (a row alone, or the rows of one record's sequences, kept together)."""

    examples: ExampleStore
    rows: Rows
    stats: EncodeStats
    group_size: int = 1
    cached_at: Path | None = None  # the dataset cache entry the examples were read from, if any

    @property
    def num_groups(self) -> int:
        return len(self.rows) // self.group_size

    def group_counts(self) -> dict[str, np.ndarray]:
        """Per group: tokens, targets, sequences, 1 group, and the causal attention pairs its documents need
        (n(n+1)/2 each: the MFU numerator's attention term), so any rank can count a whole global batch
        without communicating."""
        if not hasattr(self, "_group_counts"):
            lengths = np.asarray(self.examples.lengths, dtype=np.int64)
            per_row = {
                "tokens": self.rows.sums(lengths),
                "targets": self.rows.sums(np.asarray(self.examples.num_targets, dtype=np.int64)),
                "sequences": np.diff(self.rows.offsets),
                "attention_pairs": self.rows.sums(lengths * (lengths + 1) // 2),
                "patches": self.rows.sums(self.examples.patches),
            }
            self._group_counts = {k: v.reshape(-1, self.group_size).sum(axis=1) for k, v in per_row.items()}
            self._group_counts["groups"] = np.ones(self.num_groups, dtype=np.int64)
        return self._group_counts

    def rows_of(self, groups: Sequence[int] | np.ndarray) -> list[list[int]]:
        """The rows of these groups, in order (a group's rows consecutive)."""
        size = self.group_size
        return [self.rows[int(g) * size + k] for g in groups for k in range(size)]

    @property
    def num_targets(self) -> int:
        return int(self.examples.num_targets.sum())

    @property
    def num_tokens(self) -> int:
        return int(self.examples.offsets[-1])


def resolve_spec(spec: DatasetSpec, how: Reading) -> tuple[Path, str, FieldMap]:
    """Where one configured dataset (a file/folder path, or a named dataset_info.json entry) lives, its
    format and where its fields are."""
    if spec.name is not None:
        entry = resolve_entry(spec.name, spec.dataset_info or "", how, spec.text_column)
        if spec.format is not None and spec.format != entry.format:
            raise DataError(
                f'dataset "{spec.name}": format {spec.format} conflicts with its dataset_info formatting '
                f"({entry.format}); drop format or make them agree"
            )
        return entry.path, entry.format, entry.fields
    path = Path(spec.path or "")
    fmt = spec.format or detect_format(path, spec.text_column)
    return path, fmt, default_fields(fmt, spec.text_column)


def read_dataset(spec: DatasetSpec, how: Reading) -> list[Record]:
    """Read one configured dataset as `how` says."""
    path, fmt, fields = resolve_spec(spec, how)
    return read_records(path, fmt, how, fields, spec.max_samples)


def _read_all(specs: list[DatasetSpec], how: Reading, data: DataSection, seed: int) -> list[Record]:
    """The data sets' records, one after the other or interleaved (`data.mix`, mixing.py)."""
    sets = [read_dataset(spec, how) for spec in specs]
    records = [r for records in sets for r in records]
    if data.mix == "concat" or len(sets) < 2:
        return records
    order = interleaved([len(s) for s in sets], data.mix_probs, seed, data.mix == "interleave_over")
    return [records[i] for i in order]


def lay_out(store: ExampleStore, stats: EncodeStats, data: DataSection, seed: int, group_size: int) -> RowSet:
    """Rows and groups over encoded examples (cheap: from their lengths alone)."""
    if group_size > 1 or not data.packing:  # a group's sequences are never packed
        return RowSet(store, single_rows(len(store)), stats, group_size)
    return RowSet(store, pack_rows(store.lengths, data.max_length, seed), stats)


def _data_files(spec: DatasetSpec, how: Reading) -> list[Path]:
    """The files a dataset is read from (for the cache key; reading reports missing ones itself)."""
    if spec.name is not None:
        info = Path(spec.dataset_info or "")
        if not info.is_file():
            return []
        path = resolve_entry(spec.name, str(info), how, spec.text_column).path
        return [info, *_files_at(path)]
    return _files_at(Path(spec.path or ""))


def _files_at(path: Path) -> list[Path]:
    if path.is_dir():
        return [p for p in path.iterdir() if p.is_file()]
    return [path] if path.is_file() else []


def build_datasets(
    data: DataSection,
    how: Reading,
    encoder: Any,
    seed: int,
    group_size: int = 1,
    cache: DatasetCache | None = None,
    identity: dict[str, Any] | None = None,
    workers: int = 1,
    block_head: int | None = None,
) -> tuple[RowSet, RowSet | None]:
    """Training rows and (optional) evaluation rows; `data.eval_fraction` holds out a seeded share of
    train. With a `cache`, the encoded examples are read from it (`identity`: what the encoding depends on
    besides the data section and files), or encoded once into it (in `workers` processes); rows are laid
    out afresh either way. `block_head`: the BOS that starts each of `data.pt_blocks`' blocks (or None)."""

    def encode() -> Splits:
        train_records, eval_records = _split_records(data, how, seed)
        if how.reader == "labelled":
            both_labels(train_records, "training data")
            train_records = kto_examples(train_records, "training data")
            eval_records = kto_examples(eval_records, "evaluation data") if eval_records else []
        pair = how.reader == "pair"  # a preference pair's replies share its prompt
        if data.pt_blocks and how.reader == "text":
            train = _blocks(train_records, encoder, data, "training data", workers, block_head)
            held = (
                _blocks(eval_records, encoder, data, "evaluation data", workers, block_head)
                if eval_records
                else None
            )
            return {"train": train, "eval": held}
        out: Splits = {
            "train": _encode(train_records, encoder, data, "training data", group_size, workers, pair)
        }
        out["eval"] = (
            _encode(eval_records, encoder, data, "evaluation data", group_size, workers, pair)
            if eval_records
            else None
        )
        return out

    if cache is None:
        splits = encode()
    else:
        files = [f for spec in [*data.train, *data.eval] for f in _data_files(spec, how)]
        key = {
            # packing only lays rows out, after the cache; workers change how fast, not what, is encoded
            "data": data.model_dump(exclude={"packing", "workers"}),
            "files": file_fingerprint(files),
            "stage": how.stage,
            "seed": seed,
            "group_size": group_size,
            **(identity or {}),
        }
        splits, _ = cache.load_or_build(key, encode)
    train = lay_out(*splits["train"], data, seed, group_size)
    evaluation = lay_out(*splits["eval"], data, seed, group_size) if splits["eval"] is not None else None
    if cache is not None:
        for part in (train, evaluation):
            if part is not None:
                part.cached_at = cache.root / cache_key(key)
    return train, evaluation


def _split_records(data: DataSection, how: Reading, seed: int) -> tuple[list[Record], list[Record]]:
    """The training and evaluation records: read, mixed, then `eval_fraction` / `eval_count` held out of
    training as `train_test_split` holds them out (both parts in its permutation's order, as LLaMA-Factory
    then encodes and pairs them)."""
    train_records = _read_all(data.train, how, data, seed)
    eval_records = _read_all(data.eval, how, data, seed) if data.eval else []
    if data.eval_fraction > 0 or data.eval_count:
        held, kept = split_order(len(train_records), data.eval_count or data.eval_fraction, seed)
        if not kept:
            what = (
                f"eval_count={data.eval_count}" if data.eval_count else f"eval_fraction={data.eval_fraction}"
            )
            raise DataError(f"data.{what} leaves no training record (of {len(train_records)})")
        eval_records += [train_records[i] for i in held]
        train_records = [train_records[i] for i in kept]
    return train_records, eval_records


KL_CHUNK = 1000  # LLaMA-Factory's preprocessing_batch_size, within which it pairs KTO's KL completions


def both_labels(records: list[Record], what: str) -> None:
    """KTO trains on desirable and undesirable examples both."""
    desirable = sum(bool(r.label) for r in records)
    if desirable in (0, len(records)):
        kind = "desirable (label true)" if desirable else "undesirable (label false)"
        raise DataError(
            f"{what}: all {len(records)} KTO examples are {kind} (e.g. {records[0].source}); KTO needs both "
            f"desirable and undesirable examples"
        )


def kto_examples(records: list[Record], what: str) -> list[Record]:
    """KTO's examples, each given the previous example's completion as its mismatched completion for the KL
    estimate, within consecutive chunks of KL_CHUNK records (a chunk's first takes its last): LLaMA-Factory's
    pairing (its preprocessing batches; TRL shifts the same way within its batches), fixed whatever the
    encoding's chunks or the sampler's order."""
    if len(records) < 2:
        raise DataError(f"{what}: KTO needs at least 2 examples (each is paired with another's completion)")
    completions = [r.messages[-1]["content"] if r.messages else "" for r in records]
    paired = []
    for i, r in enumerate(records):
        start = i - i % KL_CHUNK
        size = min(KL_CHUNK, len(records) - start)
        paired.append(replace(r, mismatched=completions[start + (i - start - 1) % size]))
    return paired


def _blocks(
    records: list[Record], encoder: Any, data: DataSection, what: str, workers: int, head: int | None
) -> tuple[ExampleStore, EncodeStats]:
    """Pretraining documents as LLaMA-Factory packs them (truncate.py: pretraining_blocks)."""
    whole, stats = encode_all(records, encoder, sys.maxsize, "right", what, 1, workers)
    blocks = pretraining_blocks(whole.tokens, data.max_length, head)
    if not blocks:
        raise DataError(
            f"{what}: {len(whole.tokens)} tokens in all, less than one block of data.max_length="
            f"{data.max_length} (data.pt_blocks)"
        )
    stats.tokens_cut = len(whole.tokens) - len(blocks) * data.max_length
    flags = [np.ones(len(b), dtype=bool) for b in blocks]
    lengths = [len(b) for b in blocks]
    store = ExampleStore.from_arrays(blocks, flags, lengths, [n - 1 for n in lengths], [0] * len(blocks))
    return store, stats


def _encode(
    records: list[Record],
    encoder: Any,
    data: DataSection,
    what: str,
    group_size: int,
    workers: int = 1,
    shared_prompt: bool = False,
) -> tuple[ExampleStore, EncodeStats]:
    return encode_all(
        records, encoder, data.max_length, data.truncation, what, group_size, workers, shared_prompt,
        data.mask_history,
    )  # fmt: skip
