"""Rows of a training batch: several documents packed per row (online best fit in seeded random order), or
one per row. Rows are index arrays (CSR: `offsets` into `docs`), a few bytes per document."""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Rows:
    """Row i holds the documents docs[offsets[i]:offsets[i + 1]] (ascending)."""

    offsets: np.ndarray  # int64 [rows + 1]
    docs: np.ndarray  # int64 [documents]

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> list[int]:
        return self.docs[self.offsets[i] : self.offsets[i + 1]].tolist()

    def sums(self, per_doc: np.ndarray) -> np.ndarray:
        """Per row, the sum of a per-document quantity (int64)."""
        running = np.zeros(len(self.docs) + 1, dtype=np.int64)
        np.cumsum(per_doc[self.docs], out=running[1:])
        return running[self.offsets[1:]] - running[self.offsets[:-1]]

    def tolist(self) -> list[list[int]]:
        return [self[i] for i in range(len(self))]

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, Rows)
            and np.array_equal(self.offsets, other.offsets)
            and np.array_equal(self.docs, other.docs)
        )


def pack_rows(lengths: np.ndarray, max_length: int, seed: int = 0) -> Rows:
    """Group document indices into rows of at most `max_length` tokens, wasting little.

    Online best fit over a seeded random order: each document goes into the fullest row that still has room
    (found in one step from a bit mask of the rooms that some row has). Sorting by length first (best-fit
    decreasing) wastes slightly less but makes rows of one long document plus fillers and rows of only short
    ones, so a step's rows are no longer a random mix of the data; random order keeps every row a fair
    sample. Deterministic for a given seed.
    """
    sizes = np.asarray(lengths, dtype=np.int64).tolist()
    order = list(range(len(sizes)))
    random.Random(seed).shuffle(order)
    row_of = [0] * len(sizes)
    room_of: list[int] = []
    by_room: list[list[int]] = [[] for _ in range(max_length + 1)]  # room -> row ids with exactly that room
    rooms = 0  # bit r set: some row has exactly r tokens of room
    for doc in order:
        need = sizes[doc]
        if need > max_length:
            raise ValueError(f"document {doc} has {need} tokens > max_length {max_length}; truncate first")
        fits = rooms >> need
        if fits:
            room = need + (fits & -fits).bit_length() - 1  # the smallest room that fits
            row = by_room[room].pop()
            if not by_room[room]:
                rooms ^= 1 << room
        else:
            row = len(room_of)
            room_of.append(max_length)
        row_of[doc] = row
        left = room_of[row] = room_of[row] - need
        by_room[left].append(row)
        rooms |= 1 << left
    rows = np.asarray(row_of, dtype=np.int64)
    offsets = np.zeros(len(room_of) + 1, dtype=np.int64)
    np.cumsum(np.bincount(rows, minlength=len(room_of)), out=offsets[1:])
    return Rows(offsets, np.argsort(rows, kind="stable"))


def single_rows(count: int) -> Rows:
    """Padding mode: every document is its own row."""
    return Rows(np.arange(count + 1, dtype=np.int64), np.arange(count, dtype=np.int64))
