"""Evaluation sharded over data-parallel ranks: each rank scores its share of the eval micro-batches and the
objective's sums are added over the ranks, so evaluation costs 1/dp of a repeated pass. Ranks run their
forwards in rounds of one micro-batch each: sharded layouts (FSDP2) need every rank in every forward, so a
rank left without a micro-batch in the last round runs one with weight zero."""

from __future__ import annotations

from collections.abc import Callable

import torch

from shardforge.data.loader import RowSet
from shardforge.objectives.base import Objective
from shardforge.parallel.engine import Engine


@torch.no_grad()
def evaluate(
    engine: Engine,
    objective: Objective,
    rows: RowSet,
    micro_batch: int,
    dp: tuple[int, int],
    collate_args: tuple[int, int],
    device: torch.device,
    phase: Callable[[str], None] = lambda _: None,
) -> dict[str, float]:
    """The objective's means over all rows of `rows`: sums over every rank divided by the normalizer counted
    on the host. `dp` is (data-parallel size, this rank's index); `collate_args` (pad id, width multiple)."""
    size, rank = dp
    groups = rows.num_groups
    parts = [range(s, min(s + micro_batch, groups)) for s in range(0, groups, micro_batch)]
    names = objective.metrics
    total = torch.zeros(len(names), device=device)
    engine.model.eval()
    for start in range(0, len(parts), size):
        mine = start + rank < len(parts)
        part = parts[start + rank] if mine else parts[0]
        phase(f"evaluation, micro-batches {start + 1}-{min(start + size, len(parts))} of {len(parts)}")
        batch = objective.collate(rows.examples, rows.rows_of(part), *collate_args)
        if not mine:  # per-row zeros, for a statistic an objective reduces over the ranks (KTO's KL)
            batch.extras["counted"] = torch.zeros(batch.targets.shape[0])
        sums = engine.eval_sums(batch.to(device))
        total += torch.stack([sums[k].float() for k in names]) * float(mine)
    engine.model.train()
    means = (engine.dp_sum(total) / int(rows.group_counts()[objective.normalizer].sum())).tolist()
    return objective.finish(dict(zip(names, means, strict=True)))
