"""Rows of a training batch: several documents packed per row (online best fit in seeded random order), or
one per row."""

from __future__ import annotations

import random
from collections.abc import Sequence


def pack_rows(lengths: Sequence[int], max_length: int, seed: int = 0) -> list[list[int]]:
    """Group document indices into rows of at most `max_length` tokens, wasting little.

    Online best fit over a seeded random order: each document goes into the fullest row that still has room.
    Sorting by length first (best-fit decreasing) wastes slightly less but makes rows of one long document
    plus fillers and rows of only short ones, so a step's rows are no longer a random mix of the data;
    random order keeps every row a fair sample. Deterministic for a given seed.
    """
    order = list(range(len(lengths)))
    random.Random(seed).shuffle(order)
    rows: list[list[int]] = []
    room_of: list[int] = []
    by_room: list[list[int]] = [[] for _ in range(max_length + 1)]  # room -> row ids with exactly that room
    for doc in order:
        need = lengths[doc]
        if need > max_length:
            raise ValueError(f"document {doc} has {need} tokens > max_length {max_length}; truncate first")
        row = next((by_room[room].pop() for room in range(need, max_length + 1) if by_room[room]), None)
        if row is None:
            row = len(rows)
            rows.append([])
            room_of.append(max_length)
        rows[row].append(doc)
        room_of[row] -= need
        by_room[room_of[row]].append(row)
    return [sorted(r) for r in rows]


def single_rows(count: int) -> list[list[int]]:
    """Padding mode: every document is its own row."""
    return [[i] for i in range(count)]
