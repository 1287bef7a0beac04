"""Streaming a training corpus too large to tokenize ahead (`data.streaming: true`).

The corpus (the files of `data.train`, in order: JSONL, .txt or Parquet shards) is read lazily in windows of
`data.stream_window` records. A background thread reads, tokenizes (the tokenizer's batch call) and packs the
next window while the current one is consumed, so memory holds two windows whatever the corpus size.

Within a window, documents are packed as the in-memory pipeline packs a whole data set (online best fit in
seeded order, seed + window index) and its rows are taken in a seeded permutation (seed + epoch for the first
window of an epoch, as the global order permutes rows): a corpus that fits in one window streams exactly the
rows, in exactly the order, of the in-memory pipeline. Every rank streams the same global sequence of rows
and collates only its own share of each step, so the position (epoch, window, where the window starts: shard,
offset, line; rows of it consumed) is global: a run resumes from it exactly, on any number of ranks. The
price is that every rank reads and tokenizes the whole stream, on a thread beside the step.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from itertools import islice
from pathlib import Path
from typing import Any

import numpy as np
import torch

from shardforge.config.data_schema import DataSection, DatasetSpec
from shardforge.data.batch_source import Collate, GlobalBatch
from shardforge.data.batching import split_global_batch
from shardforge.data.cache import file_fingerprint
from shardforge.data.encode import encode_all
from shardforge.data.examples import Encoder
from shardforge.data.files import data_files, iter_from
from shardforge.data.formats import FieldMap, Reading, Record, parse_record
from shardforge.data.loader import RowSet, lay_out, resolve_spec
from shardforge.errors import DataError

ORDER_STRIDE = 7919  # the row order of window w of epoch e is seeded seed + e + ORDER_STRIDE * w


@dataclass(frozen=True)
class Shard:
    """One file of the stream, with the format and fields of its `data.train` entry."""

    path: Path
    fmt: str
    fields: FieldMap
    entry: int  # which data.train entry it belongs to
    max_samples: int | None  # that entry's cap, over all its files


@dataclass(frozen=True)
class StreamPosition:
    """Where the next record is: the shard, its byte offset and line (row, for Parquet), and how many records
    the shard's entry has given so far (for max_samples)."""

    shard: int = 0
    offset: int = 0
    line: int = 1
    taken: int = 0


def stream_shards(specs: list[DatasetSpec], how: Reading) -> list[Shard]:
    """The stream's files in reading order: the entries in turn, a folder's files by name."""
    shards = []
    for i, spec in enumerate(specs):
        path, fmt, fields = resolve_spec(spec, how)
        for file in data_files(path, fmt):
            if file.suffix.lower() == ".json":
                raise DataError(
                    f"data.train[{i}]: {file}: a .json array cannot be streamed (read from a position); "
                    f"convert it to .jsonl, one object per line, or set data.streaming=false"
                )
            shards.append(Shard(file, fmt, fields, i, spec.max_samples))
    return shards


def records_from(
    shards: list[Shard], how: Reading, start: StreamPosition
) -> Iterator[tuple[Record, StreamPosition]]:
    """The records from `start` to the end of the corpus (one epoch), each with the position after it."""
    pos = start
    while pos.shard < len(shards):
        shard, taken = shards[pos.shard], pos.taken
        if shard.max_samples is None or taken < shard.max_samples:
            for src, obj, (offset, line) in iter_from(shard.path, (pos.offset, pos.line)):
                taken += 1
                yield (
                    parse_record(obj, src, shard.fmt, shard.fields, how),
                    StreamPosition(pos.shard, offset, line, taken),
                )
                if shard.max_samples is not None and taken >= shard.max_samples:
                    break
        same_entry = pos.shard + 1 < len(shards) and shards[pos.shard + 1].entry == shard.entry
        pos = StreamPosition(pos.shard + 1, 0, 1, taken if same_entry else 0)


@dataclass
class Window:
    """A window's encoded, packed rows and the order they are taken in. `after` is where the next window
    starts; None when the epoch ends with this one."""

    epoch: int
    index: int
    rows: RowSet
    order: np.ndarray
    after: StreamPosition | None


class StreamSource:
    """Global batches of `groups_per_step` rows from a streamed corpus (see the module docstring); micro-step
    j, data-parallel rank r takes the rows [(j*dp + r)*mb, +mb) of the step's rows."""

    prefetch = True

    def __init__(
        self,
        data: DataSection,
        how: Reading,
        encoder: Encoder,
        seed: int,
        split: tuple[int, int, int, int],
        collate: Collate,
        pad_id: int,
        multiple: int = 1,
    ) -> None:
        self.shards = stream_shards(data.train, how)
        self.data, self.how, self.encoder, self.seed = data, how, encoder, seed
        self.split, self.collate, self.pad_id, self.multiple = split, collate, pad_id, multiple
        micro_batch, grad_accum, dp, _ = split
        self.groups_per_step = micro_batch * grad_accum * dp
        self.groups = math.inf  # an epoch's groups are not known before it is read
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shardforge-stream")
        self._window: Window | None = None
        self._ahead: tuple[tuple, Future] | None = None  # the next window, being built
        self.load_state_dict({"samples": 0})

    # ---- position -----------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "samples": self.samples,
            "epoch": self.epoch,
            "window": self.index,
            "start": asdict(self.start),
            "row": self.row,
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue from a saved position (rebuilding the window it points into when first needed)."""
        self.samples = int(state["samples"])
        self.epoch, self.index = int(state.get("epoch", 0)), int(state.get("window", 0))
        self.start = StreamPosition(**state.get("start", {}))
        self.row = int(state.get("row", 0))
        self._window = None

    # ---- windows ------------------------------------------------------------------------------------------
    def _build(self, epoch: int, index: int, start: StreamPosition) -> Window | None:
        """Read, encode and pack one window (None: the epoch has no record left from `start`)."""
        limit = self.data.stream_window
        read = list(islice(records_from(self.shards, self.how, start), limit))
        if not read:
            if index == 0:
                raise DataError(f"data.train: the stream has no records ({len(self.shards)} files)")
            return None
        records = [record for record, _ in read]
        what = f"training stream (window {index} of epoch {epoch}, from {records[0].source})"
        store, stats = encode_all(
            records, self.encoder, self.data.max_length, self.data.truncation, what,
            last_reply_only=self.data.mask_history,
        )  # fmt: skip
        rows = lay_out(store, stats, self.data, self.seed + index, 1)
        gen = torch.Generator().manual_seed(self.seed + epoch + ORDER_STRIDE * index)
        order = torch.randperm(rows.num_groups, generator=gen).numpy()
        return Window(epoch, index, rows, order, read[-1][1] if len(read) == limit else None)

    def _next_coordinates(self, window: Window) -> tuple[int, int, StreamPosition]:
        if window.after is None:
            return window.epoch + 1, 0, StreamPosition()
        return window.epoch, window.index + 1, window.after

    def _current(self) -> Window:
        """The window the position points into, built (or taken from the one built ahead), with the next
        one set building on the stream thread."""
        while self._window is None:
            where = (self.epoch, self.index, self.start)
            if self._ahead is not None and self._ahead[0] == where:
                window = self._ahead[1].result()
            else:
                window = self._build(*where)
            self._ahead = None
            if window is None:  # the previous window ended the epoch exactly
                self.epoch, self.index, self.start = self.epoch + 1, 0, StreamPosition()
                continue
            self._window = window
        if self._ahead is None:
            nxt = self._next_coordinates(self._window)
            self._ahead = (nxt, self._pool.submit(self._build, *nxt))
        return self._window

    # ---- batches ------------------------------------------------------------------------------------------
    def next_batch(self) -> GlobalBatch:
        picked: list[tuple[RowSet, int]] = []  # (window rows, row id) for every row of the step
        counts = dict.fromkeys(("tokens", "targets", "sequences", "groups", "attention_pairs", "patches"), 0)
        while len(picked) < self.groups_per_step:
            window = self._current()
            take = window.order[self.row : self.row + self.groups_per_step - len(picked)]
            for key, per_row in window.rows.group_counts().items():
                counts[key] += int(per_row[take].sum())
            picked += [(window.rows, int(r)) for r in take]
            self.row += len(take)
            if self.row == len(window.order):  # consumed: point at the next window (built ahead)
                self.epoch, self.index, self.start = self._next_coordinates(window)
                self.row, self._window = 0, None
        self.samples += len(picked)
        micro = [self._collate(part) for part in split_global_batch(picked, *self.split)]
        return GlobalBatch(micro, counts, self.state_dict(), float(self.epoch))

    def _collate(self, rows: list[tuple[RowSet, int]]) -> Any:
        """A micro-batch of rows that may come from two windows: their documents, renumbered."""
        examples, local = [], []
        for rowset, r in rows:
            docs = rowset.rows[r]
            local.append(list(range(len(examples), len(examples) + len(docs))))
            examples += [rowset.examples[d] for d in docs]
        return self.collate(examples, local, self.pad_id, self.multiple)

    def identity(self) -> str:
        """What the stream's position depends on (a checkpoint's `rows`): its files as they are, and how
        windows are cut and packed."""
        window = (self.data.stream_window, self.data.max_length, self.data.packing)
        files = file_fingerprint([shard.path for shard in self.shards])
        return "stream " + hashlib.sha256(repr((files, window)).encode()).hexdigest()[:16]

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
