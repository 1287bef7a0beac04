"""Pipeline parallel over a built decoder, with torch.distributed.pipelining's schedules and manual stages.

Each rank builds only its own part of the model (`split_for_pipeline`, applied on the meta device before any
weight exists): the decoder layers of its stages, plus the embedding on the first stage and the final norm
and LM head on the last. Parameter names stay those of the whole model, so checkpoints, the optimizer and
export see one model whatever the split.

A tied embedding cannot be shared across ranks: the last stage holds a copy of it as its LM head. The two
gradients are summed after each schedule run and the copy is left out of the gradient norm, so the copy
stays equal to the embedding, as in a single process.

Schedules need fixed activation shapes, declared up front (no shape-inference pass): one schedule is built
per micro-batch shape and reused while the shape repeats.
"""

from __future__ import annotations

import contextlib
import datetime
from collections import OrderedDict
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage, schedules
from torch.distributed.tensor import DTensor

from shardforge.config.schema import ONE_STAGE_SCHEDULES
from shardforge.data.batching import IGNORE, Batch
from shardforge.parallel.pipeline_plan import TORCH_SCHEDULES, PipelinePlan

LossOfLogits = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
Autocast = Callable[[], contextlib.AbstractContextManager]


def split_for_pipeline(model: nn.Module, plan: PipelinePlan, stages: list[int]) -> None:
    """Keep only what `stages` need, in place (on the meta device: nothing is allocated for the rest).
    `layers` becomes a ModuleDict keyed by the original layer index, so names stay `layers.<i>....`."""
    keep = sorted(i for s in stages for i in plan.layers[s])
    model.layers = nn.ModuleDict({str(i): model.layers[i] for i in keep})
    if 0 not in stages:
        model.embed_tokens = None
    if plan.num_stages - 1 not in stages:
        model.norm = model.lm_head = None
    elif model.config.tie_embeddings:
        weight = model.lm_head.weight
        model.lm_head.weight = nn.Parameter(torch.empty_like(weight), requires_grad=weight.requires_grad)
        # tie_weights() leaves the copy alone; init and loading fill it as the embedding.
        model.untied_copy = True


class StageModule(nn.Module):
    """One pipeline stage: its blocks (and the embedding / the head and loss on the first / last stage).
    Its modules are those of the rank's model (shared, not copied), under the same names."""

    def __init__(
        self,
        model: nn.Module,
        layers: tuple[int, ...],
        first: bool,
        last: bool,
        loss: LossOfLogits,
        autocast: Autocast = contextlib.nullcontext,
    ) -> None:
        super().__init__()
        self.embed_tokens = model.embed_tokens if first else None
        self.layers = nn.ModuleDict({str(i): model.layers[str(i)] for i in layers})
        self.norm = model.norm if last else None
        self.lm_head = model.lm_head if last else None
        self._model = [model]  # for RoPE and the attention context (a list: not registered as a child)
        self._loss, self._autocast = loss, autocast  # autocast wraps the forward only (as without pipeline)

    def blocks(self) -> list[nn.Module]:
        return list(self.layers.values())

    def forward(
        self,
        x: torch.Tensor,
        position_ids: torch.Tensor,
        doc_ids: torch.Tensor | None,
        targets: torch.Tensor,
    ) -> torch.Tensor:
        """Token ids (first stage) or the residual stream -> the stream, or the loss sum on the last stage."""
        model = self._model[0]
        with self._autocast():
            h = self.embed_tokens(x) if self.embed_tokens is not None else x
            cos, sin, ctx = model.layer_inputs(position_ids, h.dtype, doc_ids)
            for block in self.layers.values():
                h = block(h, cos, sin, ctx)
            if self.lm_head is None:
                return h
            scored = targets != IGNORE
            return self._loss(model.head(h, scored), targets[scored])


class PipelineRunner:
    """Runs one schedule over a micro-step's rows on every rank of a pipeline: returns the loss sum (on every
    pipeline rank, not only the last) after forward and backward of all pipeline micro-batches."""

    def __init__(
        self,
        plan: PipelinePlan,
        model: nn.Module,
        stages: dict[int, StageModule],
        mesh: DeviceMesh,
        device: torch.device,
        stream_dtype: torch.dtype,
        stream_width: Callable[[int], int],
        timeout: datetime.timedelta,
    ) -> None:
        self.plan, self.model, self.stages, self.device = plan, model, stages, device
        self.group = mesh["pp"].get_group()
        self.stream_dtype, self.stream_width = stream_dtype, stream_width
        self._schedules: OrderedDict[tuple, schedules._PipelineSchedule] = OrderedDict()
        self._scale: Callable[[torch.Tensor], torch.Tensor]  # set by run(), read by the loss function
        self._loss_sum: torch.Tensor
        self.tied = model.config.tie_embeddings  # every stage's rank knows: all take part in making groups
        self.pp_rank = dist.get_group_rank(self.group, dist.get_rank())
        self._tie_group = _tie_groups(mesh, plan, timeout) if self.tied and not plan.v_shaped else None

    @property
    def tied_copy(self) -> nn.Parameter | None:
        """The last stage's copy of a tied embedding (left out of the gradient norm), if this rank has it."""
        return self.model.lm_head.weight if getattr(self.model, "untied_copy", False) else None

    def _schedule(self, rows: int, width: int) -> schedules._PipelineSchedule:
        key = (rows, width)
        if key in self._schedules:
            self._schedules.move_to_end(key)
            return self._schedules[key]
        plan, m = self.plan, self.plan.microbatches
        chunk = rows // m
        meta = torch.device("meta")
        ids = torch.empty(chunk, width, dtype=torch.long, device=meta)
        stream = torch.empty(chunk, self.stream_width(width), self.model.config.hidden_size, device=meta)
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
        self._loss_sum += loss_sum.detach()
        return self._scale(loss_sum)

    def run(self, batch: Batch, scale: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """Forward and backward of `batch` in the schedule; `scale` turns a micro-batch's loss sum into what
        is differentiated. Returns the batch's loss sum on every pipeline rank."""
        rows, width = batch.input_ids.shape
        fresh = (rows, width) not in self._schedules
        schedule = self._schedule(rows, width)
        self._scale, self._loss_sum = scale, torch.zeros((), device=self.device)
        args = (batch.input_ids,) if 0 in self.stages else ()
        kwargs = {"position_ids": batch.position_ids, "doc_ids": batch.doc_ids, "targets": batch.targets}
        # A schedule's first step sets its stages up, and torch then drops the gradients of FSDP modules
        # (meant for a shape-inference pass, which declared shapes skip): the gradients accumulated by
        # earlier micro-steps are set aside around it and added back.
        kept = self._take_grads() if fresh else []
        schedule.step(*args, target=batch.targets, losses=[], return_outputs=False, **kwargs)
        for param, grad in kept:
            param.grad = grad if param.grad is None else param.grad + grad
        return self._everywhere(self._loss_sum)

    def _take_grads(self) -> list[tuple[nn.Parameter, torch.Tensor]]:
        taken = []
        for param in self.model.parameters():
            if param.grad is not None:
                taken.append((param, param.grad))
                param.grad = None
        return taken

    @torch.no_grad()
    def loss_sum(self, batch: Batch) -> torch.Tensor:
        """Forward only (evaluation): the whole batch goes through the stages in model order, each rank
        running its stages and passing the stream on with point-to-point sends; no schedule, no chunks."""
        rows, width = batch.input_ids.shape
        shape = (rows, self.stream_width(width), self.model.config.hidden_size)
        loss, h = torch.zeros((), device=self.device), batch.input_ids
        for index in range(self.plan.num_stages):
            if index not in self.stages:
                continue
            if index > 0 and self.plan.rank_of(index - 1) != self.pp_rank:
                h = torch.empty(shape, dtype=self.stream_dtype, device=self.device)
                dist.recv(h, group=self.group, group_src=self.plan.rank_of(index - 1))
            out = self.stages[index](h, batch.position_ids, batch.doc_ids, batch.targets)
            if index == self.plan.num_stages - 1:
                loss = out.detach()
            elif self.plan.rank_of(index + 1) != self.pp_rank:
                dist.send(out.contiguous(), group=self.group, group_dst=self.plan.rank_of(index + 1))
            h = out
        return self._everywhere(loss)

    def _everywhere(self, loss: torch.Tensor) -> torch.Tensor:
        """Only the last stage computes the loss: summed over the pipeline, every rank logs the same."""
        dist.all_reduce(loss, group=self.group)
        return loss

    @torch.no_grad()
    def sum_tied_grads(self) -> None:
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


def pipeline_stages(
    model: nn.Module, plan: PipelinePlan, pp_rank: int, loss: LossOfLogits, autocast: Autocast
) -> dict[int, StageModule]:
    """This rank's stage modules over its (split, TP-sharded, checkpoint-wrapped) model, by stage index."""
    last = plan.num_stages - 1
    return {
        s: StageModule(model, plan.layers[s], s == 0, s == last, loss, autocast)
        for s in plan.stages_of(pp_rank)
    }
