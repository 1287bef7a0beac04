"""Rows of a training batch: several documents packed per row (best-fit decreasing), or one per row."""

from __future__ import annotations

from collections.abc import Sequence


def pack_rows(lengths: Sequence[int], max_length: int) -> list[list[int]]:
    """Group document indices into rows of at most `max_length` tokens, wasting as little as possible.

    Best-fit decreasing: longest documents first, each into the fullest row that still has room. Deterministic
    (ties broken by index). Within a row, documents keep ascending index order.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    rows: list[list[int]] = []
    by_room: list[list[int]] = [[] for _ in range(max_length + 1)]  # room -> row ids with exactly that room
    for doc in order:
        need = lengths[doc]
        if need > max_length:
            raise ValueError(f"document {doc} has {need} tokens > max_length {max_length}; truncate first")
        row = next((by_room[room].pop() for room in range(need, max_length + 1) if by_room[room]), None)
        if row is None:
            row = len(rows)
            rows.append([])
            room = max_length
        else:
            room = max_length - sum(lengths[d] for d in rows[row])
        rows[row].append(doc)
        by_room[room - need].append(row)
    return [sorted(r) for r in rows]


def single_rows(count: int) -> list[list[int]]:
    """Padding mode: every document is its own row."""
    return [[i] for i in range(count)]
