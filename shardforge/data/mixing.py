"""Several data sets mixed into one record order, as LLaMA-Factory mixes them (`data.mix`): one after the
other (`concat`), or interleaved as Hugging Face datasets' `interleave_datasets` does (LF's
`interleave_under`: stop when one set runs out; `interleave_over`: when every set has been used whole,
the exhausted ones starting again), cycling through the sets or drawing each record's set with `probs` from
numpy's generator seeded with the run's seed. Also the held-out split of `train_test_split`. tests/lf/
checks both against LF's own data pipeline."""

from __future__ import annotations

import math

import numpy as np


def interleaved(lengths: list[int], probs: list[float] | None, seed: int, oversample: bool) -> list[int]:
    """Indices into the sets' concatenation, in the mixed order."""
    offsets = np.cumsum([0, *lengths[:-1]])
    if probs is None:
        rows = max(lengths) if oversample else min(lengths)
        picks = np.mod(np.arange(rows).reshape(-1, 1), np.array(lengths).reshape(1, -1))
        return (picks + offsets).flatten().tolist()
    exhausted = np.zeros(len(lengths), dtype=bool)
    stop = np.all if oversample else np.any
    position, out = [0] * len(lengths), []
    rng = np.random.default_rng(seed)
    while True:
        for source in rng.choice(len(lengths), size=1000, p=probs):
            if stop(exhausted):
                return out
            out.append(int(position[source] + offsets[source]))
            position[source] += 1
            if position[source] >= lengths[source]:
                exhausted[source], position[source] = True, 0


def split_order(count: int, size: float, seed: int) -> tuple[list[int], list[int]]:
    """The indices `train_test_split(test_size=size, seed=seed)` holds out of `count` records and those it
    keeps, each in its order: `size` records if a whole number, else that share rounded up, first in
    numpy's seeded permutation."""
    test = int(size) if size >= 1 else math.ceil(size * count)
    order = np.random.default_rng(seed).permutation(count).tolist()
    return order[:test], order[test:]
