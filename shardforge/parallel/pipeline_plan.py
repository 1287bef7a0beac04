"""The pipeline plan, as data: which decoder layers each stage holds, which rank runs which stage, the
schedule and its micro-batches. Pure arithmetic, checked before any process group exists.

Stages are numbered along the model (stage 0 holds the embedding, the last one the final norm, head and
loss). Looped schedules give rank r the stages r, r + pp, r + 2pp, ...; the V-shaped ones (zbv, dualpipev)
give it stages r and 2pp - 1 - r, so rank 0 holds both the first and the last stage.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from shardforge.config.parallel_schema import (
    INTERLEAVED_SCHEDULES,
    V_SCHEDULES,
    ZERO_BUBBLE_SCHEDULES,
    ParallelSection,
)
from shardforge.errors import ConfigError
from shardforge.models.spec import PipelineCosts, spec_for

# The torch.distributed.pipelining class behind each `parallel.pp_schedule`.
TORCH_SCHEDULES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved_1f1b": "ScheduleInterleaved1F1B",
    "zero_bubble": "ScheduleInterleavedZeroBubble",
    "zbv": "ScheduleZBVZeroBubble",
    "dualpipev": "ScheduleDualPipeV",
}


def bubble_fraction(schedule: str, pp: int, virtual: int, microbatches: int) -> float:
    """Idle time over compute time of the schedule, in theory: (p-1)/m for GPipe and 1F1B, (p-1)/(v*m)
    interleaved; zero-bubble schedules fill two thirds of that with weight-gradient work (Qi et al.'s
    ZB-H1 estimate, with backward split into equal input- and weight-gradient halves). The plan reports it,
    the planner's step time charges it."""
    fraction = (pp - 1) / (virtual * microbatches)
    return fraction / 3 if schedule in ZERO_BUBBLE_SCHEDULES else fraction


@dataclass(frozen=True)
class PipelinePlan:
    schedule: str
    pp: int
    virtual: int
    microbatches: int  # per schedule run, i.e. per micro-step of train.micro_batch rows
    layers: tuple[tuple[int, ...], ...]  # per stage, the decoder layers it holds
    tower: bool = False  # a vision-language model's vision modules, on the first stage

    @property
    def num_stages(self) -> int:
        return self.pp * self.virtual

    @property
    def v_shaped(self) -> bool:
        return self.schedule in V_SCHEDULES

    def stages_of(self, pp_rank: int) -> list[int]:
        """The stages rank `pp_rank` (its index along the pipeline dimension) runs, in model order."""
        if self.v_shaped:
            return [pp_rank, 2 * self.pp - 1 - pp_rank]
        return [pp_rank + k * self.pp for k in range(self.virtual)]

    def rank_of(self, stage: int) -> int:
        return next(r for r in range(self.pp) if stage in self.stages_of(r))

    @property
    def bubble_fraction(self) -> float:
        return bubble_fraction(self.schedule, self.pp, self.virtual, self.microbatches)

    def describe(self) -> str:
        parts = []
        for stage, layers in enumerate(self.layers):
            what = [f"layers {layers[0]}-{layers[-1]}" if len(layers) > 1 else f"layer {layers[0]}"]
            if stage == 0:
                what[:0] = ["embedding", "vision tower"] if self.tower else ["embedding"]
            if stage == self.num_stages - 1:
                what.append("norm + head + loss")
            parts.append(f"stage {stage} (rank {self.rank_of(stage)}): {' + '.join(what)}")
        return (
            f"pipeline {self.schedule}, {self.pp} ranks x {self.virtual} stage(s), {self.microbatches} "
            f"micro-batches per micro-step, theoretical bubble {self.bubble_fraction:.1%}; "
            + "; ".join(parts)
        )


def plan_pipeline(
    model_config: Any, parallel: ParallelSection, micro_batch: int, seq_len: int
) -> PipelinePlan | None:
    """The plan for this config (None without pipeline parallel). Every rule that a bad value would break
    at run time (or make hang) is a ConfigError here, naming the key and what would be valid."""
    if parallel.pp == 1:
        return None
    pp, virtual, name = parallel.pp, parallel.pp_virtual, parallel.pp_schedule
    stages = pp * virtual
    m = parallel.pp_microbatches or stages
    default = "" if parallel.pp_microbatches else " (the default: pp x pp_virtual)"
    if micro_batch % m:
        raise ConfigError(
            f"parallel.pp_microbatches={m}{default} must divide train.micro_batch={micro_batch}: each "
            f"micro-step's {micro_batch} rows per data-parallel rank are split into that many pipeline "
            f"micro-batches"
        )
    if name == "1f1b" and m < pp:
        raise ConfigError(
            f"parallel.pp_schedule=1f1b needs at least as many micro-batches as stages: "
            f"parallel.pp_microbatches={m} < parallel.pp={pp} (raise it, with train.micro_batch a multiple)"
        )
    if name == "dualpipev" and m < stages:
        raise ConfigError(
            f"parallel.pp_schedule=dualpipev needs at least as many micro-batches as stages: "
            f"parallel.pp_microbatches={m} < {stages} (pp x pp_virtual)"
        )
    rounds = max(1, m // pp)
    if name in INTERLEAVED_SCHEDULES and m % rounds:
        raise ConfigError(
            f"parallel.pp_schedule={name} runs micro-batches in rounds of pp={pp}: parallel.pp_microbatches="
            f"{m} must be a multiple of its {rounds} rounds (pp_microbatches // pp), e.g. {rounds * pp}"
        )
    counts = (
        parse_layer_counts(parallel.pp_layers, model_config.num_layers, stages)
        if parallel.pp_layers
        else balance_layers(spec_for(model_config.family).costs(model_config).pipeline(seq_len), stages)
    )
    layers, start = [], 0
    for n in counts:
        layers.append(tuple(range(start, start + n)))
        start += n
    return PipelinePlan(name, pp, virtual, m, tuple(layers), model_config.takes_images)


def parse_layer_counts(text: str, num_layers: int, stages: int) -> list[int]:
    """`parallel.pp_layers`, e.g. "3,4,4,3": decoder layers per stage, in model order."""
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        raise ConfigError(
            f"parallel.pp_layers={text!r}: expected comma-separated layer counts, one per stage, e.g. "
            f"'3,4,4,3'"
        ) from None
    if len(counts) != stages:
        raise ConfigError(
            f"parallel.pp_layers={text!r} lists {len(counts)} stage(s); pp x pp_virtual = {stages} stages"
        )
    if min(counts) < 1:
        raise ConfigError(f"parallel.pp_layers={text!r}: every stage needs at least one decoder layer")
    if sum(counts) != num_layers:
        raise ConfigError(
            f"parallel.pp_layers={text!r} places {sum(counts)} layers; the model has {num_layers}"
        )
    return counts


def balance_layers(costs: PipelineCosts, stages: int) -> list[int]:
    """Contiguous layer counts per stage (at least one each) minimizing the costliest stage, with the
    embedding's cost on the first stage and the head's on the last (dynamic programming over cut points)."""
    n = len(costs.layers)
    if n < stages:
        raise ConfigError(
            f"the model has {n} decoder layers, fewer than the {stages} pipeline stages (pp x pp_virtual): "
            f"every stage needs at least one; lower parallel.pp or parallel.pp_virtual"
        )
    prefix = [0.0]
    for c in costs.layers:
        prefix.append(prefix[-1] + c)

    def cost(stage: int, lo: int, hi: int) -> float:
        extra = (costs.embed if stage == 0 else 0.0) + (costs.head if stage == stages - 1 else 0.0)
        return prefix[hi] - prefix[lo] + extra

    inf = float("inf")
    # best[s][i]: the lowest possible maximum over stages 0..s-1 holding layers 0..i-1.
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for s in range(1, stages + 1):
        for i in range(s, n - (stages - s) + 1):
            for j in range(s - 1, i):
                value = max(best[s - 1][j], cost(s - 1, j, i))
                if value < best[s][i]:
                    best[s][i], cut[s][i] = value, j
    counts, i = [], n
    for s in range(stages, 0, -1):
        counts.append(i - cut[s][i])
        i = cut[s][i]
    return counts[::-1]


def split_for_pipeline(model: nn.Module, plan: PipelinePlan, stages: list[int]) -> None:
    """Prune a model (still on the meta device) to what this rank's `stages` need, by the family's own rule
    (`model.prune`)."""
    keep = sorted(i for s in stages for i in plan.layers[s])
    model.prune(keep, first=0 in stages, last=plan.num_stages - 1 in stages)
