"""Pipeline parallel over a built decoder, with torch.distributed.pipelining's schedules and manual stages.

Each rank builds only its own part of the model (`pipeline_plan.split_for_pipeline`, applied on the meta
device before any weight exists): the decoder layers of its stages, plus the embedding on the first stage and
the final norm and LM head on the last. Parameter names stay those of the whole model, so checkpoints, the
optimizer and export see one model whatever the split. Each stage runs a `part` of that model through the
model's own forward; the last one computes the objective's sums on its chunk of the micro-batch.

A tied embedding cannot be shared across ranks: the last stage holds a copy of it as its LM head. The two
gradients are summed once per optimizer step and the copy is left out of the gradient norm, so the copy
stays equal to the embedding, as in a single process.

Schedules need fixed activation shapes, declared up front (no shape-inference pass): one schedule is built
per micro-batch shape and reused while the shape repeats.
"""

from __future__ import annotations

import datetime
import functools
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage, schedules
from torch.distributed.tensor import DTensor

from shardforge.config.parallel_schema import ONE_STAGE_SCHEDULES
from shardforge.parallel.context_parallel import batch_splitter
from shardforge.parallel.data_parallel import kept_unsharded
from shardforge.parallel.dims import ParallelDims
from shardforge.parallel.engine import (
    Autocast,
    Differentiate,
    StepObjective,
    clip_grad_norm,
    dp_sum,
    gathered_state,
)
from shardforge.parallel.images import placed
from shardforge.parallel.pipeline_plan import TORCH_SCHEDULES, PipelinePlan
from shardforge.parallel.tensor_parallel import loss_context, strip_vocab_padding


class StageModule(nn.Module):
    """One pipeline stage: a view of the rank's model holding the stage's blocks (and the embedding / the norm
    and head on the first / last stage), run by the model's own forward. The last stage also computes the
    objective's sums: it returns the differentiated loss sum and hands every sum to `record`."""

    def __init__(
        self,
        part: nn.Module,
        last: bool,
        objective: StepObjective,
        autocast: Autocast,
        record: Callable[[dict], None],
    ) -> None:
        super().__init__()
        self.part = part
        self._last, self._objective, self._autocast, self._record = last, objective, autocast, record
        self._batch_type: type | None = None  # set by the engine: how a chunk of per-row tensors is rebuilt

    def blocks(self) -> list[nn.Module]:
        return self.part.blocks()

    def forward(self, x: torch.Tensor, **fields: torch.Tensor | None) -> torch.Tensor:
        """Token ids (first stage) or the residual stream -> the stream, or the loss sum on the last stage."""
        chunk = self._batch_type.from_fields(None, fields)
        inputs = self._objective.model_inputs(chunk)
        inputs.pop("doc_layout", None)  # not a per-row tensor: packed chunks use the block-diagonal mask
        with self._autocast():
            out = self.part(x, **inputs)
            if not self._last:
                return out
            sums = self._objective.loss(out, chunk)
        self._record({k: v.detach() for k, v in sums.items()})
        return sums["loss"]


class PipelineEngine:
    """Runs one schedule per micro-step over the rank's stages (forward and backward of every pipeline
    micro-batch); every pipeline rank gets the objective's sums, not only the last."""

    is_pipeline = True

    def __init__(
        self,
        *,
        plan: PipelinePlan,
        model: nn.Module,
        objective: StepObjective,
        dims: ParallelDims,
        mesh: DeviceMesh,
        device: torch.device,
        autocast: Autocast,
        stream_dtype: torch.dtype,
        sequence_parallel: bool,
        timeout: datetime.timedelta,
    ) -> None:
        self.plan, self.model, self.inner, self.objective = plan, model, model, objective
        self.dims, self.mesh, self.device = dims, mesh, device
        self.split = batch_splitter(dims, mesh, self.model)  # this rank's part of each row under cp
        self.group = mesh["pp"].get_group()
        self.stream_dtype = stream_dtype
        self.sp_split = dims.tp if sequence_parallel else 1  # sequence parallel splits the stream's tokens
        self._schedules: OrderedDict[tuple, schedules._PipelineSchedule] = OrderedDict()
        self._differentiate: Differentiate  # set per run, read by the loss function
        self._sums: list[dict[str, torch.Tensor]] = []
        self.tied = model.config.tie_embeddings  # every stage's rank knows: all take part in making groups
        self.pp_rank = dist.get_group_rank(self.group, dist.get_rank())
        self._tie_group = _tie_groups(mesh, plan, timeout) if self.tied and not plan.v_shaped else None
        last = plan.num_stages - 1
        self.stages = {
            s: StageModule(
                model.part(list(plan.layers[s]), s == 0, s == last),
                s == last,
                objective,
                autocast,
                self._sums.append,
            )
            for s in plan.stages_of(self.pp_rank)
        }
        self.params: list[nn.Parameter] = []  # set by `parallelize` once data parallel has sharded the stages

    @property
    def tied_copy(self) -> nn.Parameter | None:
        """The last stage's copy of a tied embedding (left out of the gradient norm), if this rank has it."""
        return self.model.lm_head.weight if self.model.untied_copy else None

    def _schedule(self, rows: int, width: int) -> schedules._PipelineSchedule:
        key = (rows, width)
        if key in self._schedules:
            self._schedules.move_to_end(key)
            return self._schedules[key]
        plan, m = self.plan, self.plan.microbatches
        chunk = rows // m
        meta = torch.device("meta")
        ids = torch.empty(chunk, width, dtype=torch.long, device=meta)
        stream = torch.empty(chunk, width // self.sp_split, self.model.config.hidden_size, device=meta)
        stream = stream.to(self.stream_dtype).requires_grad_()  # gradients flow back through it
        loss = torch.empty((), dtype=torch.float32, device=meta)
        built = [
            PipelineStage(
                module,
                index,
                plan.num_stages,
                self.device,
                input_args=ids if index == 0 else stream,
                output_args=loss if index == plan.num_stages - 1 else stream,
                group=self.group,
            )
            for index, module in self.stages.items()
        ]
        cls = getattr(schedules, TORCH_SCHEDULES[plan.schedule])
        one = plan.schedule in ONE_STAGE_SCHEDULES
        schedule = cls(built[0] if one else built, m, loss_fn=self._loss_fn, scale_grads=False)
        self._schedules[key] = schedule
        if len(self._schedules) > 8:  # widths come in steps of max_length / 8: keep the recent ones
            self._schedules.popitem(last=False)
        return schedule

    def _loss_fn(self, loss_sum: torch.Tensor, _target: torch.Tensor) -> torch.Tensor:
        return self._differentiate(loss_sum)

    def _prepare(self, batch: Any) -> None:
        for stage in self.stages.values():
            stage._batch_type = type(batch)
        self._sums.clear()

    def forward_backward(
        self, batch: Any, differentiate: Differentiate, sync: bool
    ) -> dict[str, torch.Tensor]:
        """Forward and backward of `batch` in the schedule (torch's stages reduce FSDP gradients at the end
        of every schedule run, whatever `sync` says)."""
        batch = placed(self.model, self.split(batch) if self.split is not None else batch)
        rows, width = batch.input_ids.shape
        fresh = (rows, width) not in self._schedules
        schedule = self._schedule(rows, width)
        self._prepare(batch)
        self._differentiate = differentiate
        args = (batch.input_ids,) if 0 in self.stages else ()
        # A schedule's first step sets its stages up, and torch then drops the gradients of FSDP modules
        # (meant for a shape-inference pass, which declared shapes skip): the gradients accumulated by
        # earlier micro-steps are set aside around it and added back.
        kept = self._take_grads() if fresh else []
        with loss_context(self.dims):
            schedule.step(*args, target=batch.targets, losses=[], return_outputs=False, **batch.fields())
        for param, grad in kept:
            param.grad = grad if param.grad is None else param.grad + grad
        return self._everywhere()

    def _take_grads(self) -> list[tuple[nn.Parameter, torch.Tensor]]:
        taken = []
        for param in self.model.parameters():
            if param.grad is not None:
                taken.append((param, param.grad))
                param.grad = None
        return taken

    @torch.no_grad()
    def eval_sums(self, batch: Any) -> dict[str, torch.Tensor]:
        """Forward only: the whole batch goes through the stages in model order (no schedule, no chunks),
        the last computing the objective's sums."""
        batch = placed(self.model, self.split(batch) if self.split is not None else batch)
        self._prepare(batch)
        fields = batch.fields()
        with loss_context(self.dims):
            self.through_stages(batch.input_ids, lambda index, h: self.stages[index](h, **fields))
        return self._everywhere()

    @torch.no_grad()
    def forward_only(
        self, input_ids: torch.Tensor, inputs: dict[str, Any], net: nn.Module | None = None
    ) -> Any:
        """The whole model's output for a batch (its forward's keyword `inputs`), stage by stage: on the
        rank of the last stage, what the model returns there (e.g. the targets' log-probs); None elsewhere.
        `net`: a model pruned to the same stages (a frozen reference copy, whose stages are views of it that
        its FSDP2 root never sees run: it is gathered whole for the pass); None: the trained model's
        stages. RL scores its rollouts with it (objectives/rollout.py)."""
        last = self.plan.num_stages - 1

        def run(index: int, h: torch.Tensor) -> Any:
            part = (
                self.stages[index].part
                if net is None
                else net.part(list(self.plan.layers[index]), index == 0, index == last)
            )
            return part(h, **inputs)

        with kept_unsharded([net] if net is not None else []):
            out = self.through_stages(input_ids, run)
        return out if last in self.stages else None

    def fsdp_roots(self) -> list[nn.Module]:
        return list(self.stages.values())

    @functools.cache  # noqa: B019 (one per engine, which lives as long as the run)
    def rollout_group(self) -> dist.ProcessGroup | None:
        return self.dims.model_group(self.mesh)

    def from_last_stage(self, stats: dict[str, float]) -> dict[str, float]:
        if not stats:
            return stats
        values = torch.tensor(list(stats.values()), dtype=torch.float64, device=self.device)
        dist.broadcast(values, group=self.group, group_src=self.plan.rank_of(self.plan.num_stages - 1))
        return dict(zip(stats, values.tolist(), strict=True))

    def through_stages(self, input_ids: torch.Tensor, run: Callable[[int, torch.Tensor], Any]) -> Any:
        """Each of the rank's stages in model order, the stream received from the previous stage's rank and
        sent to the next one's with point-to-point messages; returns the rank's last stage's output."""
        rows, width = input_ids.shape
        shape = (rows, width // self.sp_split, self.model.config.hidden_size)
        h = input_ids
        for index in range(self.plan.num_stages):
            if index not in self.stages:
                continue
            if index > 0 and self.plan.rank_of(index - 1) != self.pp_rank:
                h = torch.empty(shape, dtype=self.stream_dtype, device=self.device)
                dist.recv(h, group=self.group, group_src=self.plan.rank_of(index - 1))
            out = run(index, h)
            if index < self.plan.num_stages - 1 and self.plan.rank_of(index + 1) != self.pp_rank:
                dist.send(
                    out.to(self.stream_dtype).contiguous(),
                    group=self.group,
                    group_dst=self.plan.rank_of(index + 1),
                )
            h = out
        return h

    def _everywhere(self) -> dict[str, torch.Tensor]:
        """Only the last stage computes the sums: added over the pipeline, every rank has them (in the
        objective's metric order, so ranks without them take part alike)."""
        names = self.objective.metrics
        total = torch.zeros(len(names), device=self.device)
        for sums in self._sums:
            total += torch.stack([sums[k].float() for k in names])
        self._sums.clear()
        dist.all_reduce(total, group=self.group)
        return dict(zip(names, total.unbind(), strict=True))

    @torch.no_grad()
    def reduce_tied_grads(self) -> None:
        """The embedding's gradient and its copy's (the LM head's) both become their sum: once per optimizer
        step, after the last micro-step (collective over the first and last stages' ranks)."""
        if not self.tied:
            return
        embed, head = self.model.embed_tokens, self.model.lm_head
        if embed is None and head is None:  # a middle stage
            return
        grads = [_grad_as_param(m.weight) for m in (embed, head) if m is not None]
        if len(grads) == 2:  # V-shaped: this rank holds the first and the last stage
            total = grads[0] + grads[1]
            grads[0].copy_(total)
            grads[1].copy_(total)
            return
        dist.all_reduce(
            grads[0].to_local() if isinstance(grads[0], DTensor) else grads[0], group=self._tie_group
        )

    def clip(self, max_norm: float | None) -> torch.Tensor:
        return clip_grad_norm(self.params, max_norm, self.group, self.tied_copy)

    def dp_sum(self, value: torch.Tensor) -> torch.Tensor:
        return dp_sum(value, self.dims, self.mesh)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full weights of every stage, merged on rank 0: each stage gathers its tensors one at a time over
        data and tensor parallel (to host memory, on the ranks that send them on), then the pipeline group
        that holds rank 0 sends them there."""
        sender = 0 in self.mesh["pp"].mesh.tolist()
        state = dict(gathered_state(self.inner, sender, self.device))
        if not sender:
            return {}
        main = dist.get_rank() == 0
        parts: list[dict] | None = [{} for _ in range(self.dims.pp)] if main else None
        dist.gather_object(state, parts, dst=0, group=self.group)
        merged = {k: v for part in parts or [] for k, v in part.items()}
        return strip_vocab_padding(merged, self.model.config.vocab_size)


def _grad_as_param(param: nn.Parameter) -> torch.Tensor:
    """The gradient, laid out like its parameter. Under TP the embedding's gradient can come back replicated
    while the weight is split over the vocabulary; the head's is split like its weight. Summing them
    shard by shard needs one layout."""
    grad = param.grad
    if isinstance(grad, DTensor) and grad.placements != param.placements:
        param.grad = grad = grad.redistribute(param.device_mesh, param.placements)
    return grad


def _tie_groups(
    mesh: DeviceMesh, plan: PipelinePlan, timeout: datetime.timedelta
) -> dist.ProcessGroup | None:
    """For each position in the other mesh dimensions, a group of the first stage's rank and the last's; every
    rank creates all of them (in the same order), and keeps the one it belongs to."""
    ranks = mesh.mesh.reshape(plan.pp, -1)  # pp is the outermost mesh dimension
    first, last = plan.rank_of(0), plan.rank_of(plan.num_stages - 1)
    mine = None
    for column in range(ranks.shape[1]):
        pair = sorted({int(ranks[first, column]), int(ranks[last, column])})
        group = dist.new_group(pair, timeout=timeout)
        if dist.get_rank() in pair:
            mine = group
    return mine
