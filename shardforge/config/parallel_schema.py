"""The config's parallel section: the layout's degrees and schedules, and the rules a layout must keep."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from shardforge.config.section import Section

# Pipeline schedules by how many stages each rank runs, and which split backward (zero bubble).
ONE_STAGE_SCHEDULES = ("gpipe", "1f1b")
INTERLEAVED_SCHEDULES = ("interleaved_1f1b", "zero_bubble")  # pp_virtual >= 2 stages per rank
V_SCHEDULES = ("zbv", "dualpipev")  # exactly 2 stages per rank: r and 2pp-1-r
ZERO_BUBBLE_SCHEDULES = ("zero_bubble", "zbv", "dualpipev")


def zero_bubble_refusal(parallel: ParallelSection, replicas: int = 1, world_size: int = 1) -> str | None:
    """Why `parallel` may not run its zero-bubble schedule, else None: the schedule's weight-gradient pass
    does not reach FSDP2's gathered parameters, and DDP does not take pipeline stages, so it runs without
    data parallel. The one home of that rule: the config refuses what it knows (zero_stage >= 2),
    ParallelDims what the world size tells (the data-parallel `replicas` it resolved)."""
    if parallel.pp == 1 or parallel.pp_schedule not in ZERO_BUBBLE_SCHEDULES:
        return None
    if parallel.zero_stage >= 2:
        return (
            f"parallel.pp_schedule={parallel.pp_schedule} computes weight gradients in a pass of their own, "
            f"which does not reach FSDP2's gathered parameters (torch 2.13), so it cannot be combined "
            f"with data parallel: with parallel.zero_stage={parallel.zero_stage} use pp_schedule 1f1b, gpipe "
            f"or interleaved_1f1b"
        )
    if replicas > 1:
        return (
            f"parallel.pp_schedule={parallel.pp_schedule} cannot be combined with data parallel "
            f"({replicas} replicas here): use 1f1b, gpipe or interleaved_1f1b with "
            f"parallel.zero_stage 2 or 3, or use all {world_size} processes for pp x tp"
        )
    return None


class ParallelSection(Section):
    """Parallel layout. Degrees multiply to the world size; -1 on dp_shard means "the rest of the world".
    auto: the planner chooses every degree, ZeRO stage, checkpointing, offload and the micro-batch (for the
    same global batch) at launch; `parallel: auto` in YAML is short for `parallel: {auto: true}`."""

    auto: bool = False
    dp_replicate: int = Field(default=1, ge=1)
    dp_shard: int = Field(default=-1, ge=-1)
    tp: int = Field(default=1, ge=1)
    pp: int = Field(default=1, ge=1)
    cp: int = Field(default=1, ge=1)
    ep: int = Field(default=1, ge=1)
    cp_mode: Literal["allgather", "ulysses"] = "allgather"  # K/V all-gathered (Llama 3) or heads all-to-all
    zero_stage: Literal[0, 1, 2, 3] = 0
    offload: Literal["none", "optimizer", "params"] = "none"
    grad_compression: Literal["none", "fp16", "powersgd"] = "none"
    powersgd_rank: int = Field(default=1, ge=1)
    reduce_dtype: Literal["fp32", "bf16"] = "fp32"
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    timeout_minutes: float = Field(default=10.0, gt=0)
    sequence_parallel: bool = True
    activation_checkpoint: Literal["none", "full", "selective"] = "none"
    pp_schedule: Literal["gpipe", "1f1b", "interleaved_1f1b", "zero_bubble", "zbv", "dualpipev"] = "1f1b"
    pp_microbatches: int | None = Field(default=None, ge=1)  # per micro-step; None: one per stage
    pp_virtual: int = Field(default=1, ge=1)  # stages per pipeline rank (interleaved and V schedules)
    pp_layers: str | None = None  # decoder layers per stage, e.g. "3,4,4,3"; None: balanced by cost

    @model_validator(mode="after")
    def _built_layouts_only(self) -> ParallelSection:
        if self.cp > 1 and self.dp_replicate > 1 and self.zero_stage >= 2:
            raise ValueError(
                f"parallel.cp={self.cp} with HSDP (dp_replicate={self.dp_replicate} x sharding): not "
                f"supported; use dp_replicate=1 (FSDP over dp_shard x cp) or zero_stage 0/1"
            )
        if self.ep > 1 and (self.zero_stage < 2 or self.dp_replicate > 1):
            raise ValueError(
                f"parallel.ep={self.ep} splits the experts over data-parallel ranks that shard the model: "
                f"set parallel.zero_stage to 2 or 3 and parallel.dp_replicate=1 (it is zero_stage="
                f"{self.zero_stage}, dp_replicate={self.dp_replicate})"
            )
        self._check_pipeline()
        if self.dp_shard == 0:
            raise ValueError("parallel.dp_shard must be >= 1, or -1 for the rest of the world")
        if self.offload != "none" and self.zero_stage < 2:
            raise ValueError(
                f"parallel.offload={self.offload} needs sharded states: set parallel.zero_stage to 2 or 3 "
                f"(it is {self.zero_stage})"
            )
        if self.grad_compression != "none" and self.zero_stage >= 2:
            raise ValueError(
                f"parallel.grad_compression={self.grad_compression} is a DDP communication hook: it needs "
                f"parallel.zero_stage 0 or 1 (it is {self.zero_stage})"
            )
        return self

    def _check_pipeline(self) -> None:
        if self.pp == 1:
            fields = ParallelSection.model_fields
            defaults = {k: field.default for k, field in fields.items() if k.startswith("pp_")}
            unused = [k for k, default in defaults.items() if getattr(self, k) != default]
            if unused:
                raise ValueError(
                    f"parallel.{unused[0]} is set but parallel.pp=1: set parallel.pp > 1 to use it"
                )
            return
        if self.pp_schedule in ONE_STAGE_SCHEDULES and self.pp_virtual != 1:
            raise ValueError(
                f"parallel.pp_schedule={self.pp_schedule} runs one stage per rank, but parallel.pp_virtual="
                f"{self.pp_virtual}: use interleaved_1f1b or zero_bubble for virtual stages, or pp_virtual=1"
            )
        if self.pp_schedule in INTERLEAVED_SCHEDULES and self.pp_virtual < 2:
            raise ValueError(
                f"parallel.pp_schedule={self.pp_schedule} interleaves several stages per rank: set "
                f"parallel.pp_virtual >= 2 (it is {self.pp_virtual})"
            )
        if (refused := zero_bubble_refusal(self)) is not None:
            raise ValueError(refused)
        if self.pp_schedule in V_SCHEDULES and self.pp_virtual != 2:
            raise ValueError(
                f"parallel.pp_schedule={self.pp_schedule} is V-shaped, exactly two stages per rank: set "
                f"parallel.pp_virtual=2 (it is {self.pp_virtual})"
            )
