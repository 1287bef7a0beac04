"""Where the loop's global batches come from, and the loader that draws them ahead.

The loop pulls one `GlobalBatch` per optimizer step from a `BatchSource`: a tokenized data set
(`DatasetSource`: a seeded global order over groups, split over data-parallel ranks and micro-steps), a
streamed corpus (data/stream.py) or RL rollouts made with the training weights (objectives/rollout.py),
without the loop knowing which: the objective builds it (`Objective.batch_source`). The source's position is
what a checkpoint stores, so a resumed run continues with exactly the batches it would have seen.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

from shardforge.data.batching import Batch, GlobalOrder, split_global_batch
from shardforge.data.examples import Example
from shardforge.data.loader import RowSet

Collate = Callable[[Sequence[Example], Sequence[Sequence[int]], int, int], Batch]


@dataclass
class GlobalBatch:
    """This rank's micro-batches of one optimizer step, and counts over the whole global batch (all ranks,
    known on the host before the step: tokens, targets, sequences, groups, attention_pairs)."""

    micro: list[Batch]
    counts: dict[str, int]
    state: dict  # the source's position once this batch is consumed (JSON-able; "samples": groups so far)
    epoch: float  # epochs of data consumed (for the logs)
    stats: dict[str, float] = field(default_factory=dict)  # the source's own figures (rollouts: rewards...)


class BatchSource(Protocol):
    prefetch: bool  # may the next batch be drawn ahead on a thread while the current step runs?
    groups: float  # the groups of an epoch (math.inf for a stream)

    def next_batch(self) -> GlobalBatch: ...

    def identity(self) -> Any:
        """What a checkpoint's data position refers to (part of its signature, checked on resume)."""
        ...

    def load_state_dict(self, state: dict) -> None: ...

    def close(self) -> None: ...


class DatasetSource:
    """Global batches of `groups_per_step` groups from a RowSet: micro-step j, data-parallel rank r takes
    the groups [(j*dp + r)*mb, +mb) of the step's positions in the seeded global order."""

    prefetch = True

    def __init__(
        self,
        rows: RowSet,
        seed: int,
        micro_batch: int,
        grad_accum: int,
        dp: int,
        dp_rank: int,
        collate: Collate,
        pad_id: int,
        multiple: int = 1,
    ) -> None:
        self.rows, self.collate, self.pad_id, self.multiple = rows, collate, pad_id, multiple
        self.split = (micro_batch, grad_accum, dp, dp_rank)
        self.groups_per_step = micro_batch * grad_accum * dp
        self.order = GlobalOrder(rows.num_groups, seed)
        self.groups: float = rows.num_groups

    def next_batch(self) -> GlobalBatch:
        ids = self.order.take(self.groups_per_step)
        counts = {key: int(per_group[ids].sum()) for key, per_group in self.rows.group_counts().items()}
        micro = [
            self.collate(self.rows.examples, self.rows.rows_of(part), self.pad_id, self.multiple)
            for part in split_global_batch(ids, *self.split)
        ]
        position = self.order.position
        return GlobalBatch(micro, counts, {"samples": position}, position / self.rows.num_groups)

    def identity(self) -> int:
        return len(self.rows.rows)

    def load_state_dict(self, state: dict) -> None:
        self.order.position = int(state["samples"])

    def close(self) -> None:
        pass


class GlobalBatchLoader:
    """Hands out the source's global batches, drawing the next one on a background thread while the current
    step computes (when the source allows), so data preparation never stalls a step. `state_dict()` is the
    position after the last batch handed out, not after the one drawn ahead."""

    def __init__(self, source: BatchSource, batches: int) -> None:
        self.source, self.left = source, batches
        self.state: dict = {"samples": 0}
        self.epoch = 0.0
        self.stats: list[dict[str, float]] = []  # the batches' own figures since take_stats()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shardforge-data")
        self._pending: Future | None = None

    def next(self) -> GlobalBatch:
        if self.left <= 0:
            raise StopIteration("the loader's batches are all handed out")
        # A source that is not drawn ahead runs on this thread: another one gains nothing, and torch ops on a
        # second thread ran 2.5x slower here (rollouts: its own OpenMP team).
        batch = self._pending.result() if self._pending is not None else self.source.next_batch()
        self.left -= 1
        ahead = self.left > 0 and self.source.prefetch
        self._pending = self._pool.submit(self.source.next_batch) if ahead else None
        self.state, self.epoch = batch.state, batch.epoch
        self.stats.append(batch.stats)
        return batch

    def take_stats(self) -> dict[str, float]:
        """Each figure the sources' batches reported since the last call, averaged over the batches that
        reported it (for the log record of a window of steps)."""
        keys = dict.fromkeys(k for stats in self.stats for k in stats)
        out = {k: sum(s[k] for s in self.stats if k in s) / sum(k in s for s in self.stats) for k in keys}
        self.stats = []
        return out

    def state_dict(self) -> dict:
        return dict(self.state)

    def load_state_dict(self, state: dict) -> None:
        """Continue from a saved position (before the first batch is drawn)."""
        self.source.load_state_dict(state)
        self.state = dict(state)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.source.close()
