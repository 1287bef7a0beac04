"""The engine: what the loop calls to run a micro-batch on whatever layout the model was given.

`parallelize` (parallel/parallelize.py) returns an Engine; the loop never asks which layout it has. Two
implementations share this interface: `PlainEngine` (one process, DDP, ZeRO, FSDP2, TP: one module runs the
whole forward) and `PipelineEngine` (parallel/pipeline.py: a schedule runs the rank's stages).

The objective is duck-typed here (`model_inputs(batch)`, `loss(output, batch) -> sums`, `metrics`), and so are
batches (`input_ids`, `fields()`, `from_fields()`): the parallel layer knows neither objectives nor data.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from shardforge.models.common.protocol import CausalModel
from shardforge.models.quantize import dequantized, is_nf4
from shardforge.parallel.context_parallel import batch_splitter
from shardforge.parallel.data_parallel import gradient_sync
from shardforge.parallel.dims import ParallelDims
from shardforge.parallel.tensor_parallel import loss_context, strip_vocab_padding

# A micro-batch's loss sum -> what backward starts from (the loop's scaling and the fp16 loss scale).
Differentiate = Callable[[torch.Tensor], torch.Tensor]
Autocast = Callable[[], contextlib.AbstractContextManager]


class StepObjective(Protocol):
    """What the engines call of an objective (objectives/base.py: `Objective` implements it): the parallel
    layer sits below objectives/ and knows it only by this."""

    metrics: tuple[str, ...]  # the keys `loss` returns, "loss" first

    def prepare(self, model: nn.Module, batch: Any) -> Any: ...

    def model_inputs(self, batch: Any) -> dict[str, Any]: ...

    def loss(self, output: Any, batch: Any) -> dict[str, torch.Tensor]: ...


class Engine(Protocol):
    model: nn.Module  # what runs forward: a DDP wrapper, an FSDP2/TP model, or the rank's pipeline part
    inner: CausalModel  # the rank's model itself (parameter names, state dicts, checkpoints)
    params: list[nn.Parameter]  # trainable parameters of this rank
    is_pipeline: bool
    device: torch.device  # where the rank computes

    def forward_backward(
        self, batch: Any, differentiate: Differentiate, sync: bool
    ) -> dict[str, torch.Tensor]:
        """Forward and backward of a micro-batch; returns the objective's sums (detached, on every rank).
        `sync=False` on all but the last micro-step of an accumulation skips the gradient reduction."""
        ...

    def eval_sums(self, batch: Any) -> dict[str, torch.Tensor]:
        """Forward only: the objective's sums for a batch (on every rank of this data-parallel replica)."""
        ...

    def reduce_tied_grads(self) -> None:
        """Sum the gradients of weights held twice (a tied embedding across pipeline stages)."""
        ...

    def clip(self, max_norm: float | None) -> torch.Tensor:
        """Global gradient norm over every rank's shards and stages; clips when max_norm is set."""
        ...

    def dp_sum(self, value: torch.Tensor) -> torch.Tensor:
        """Sum over the data-parallel ranks, in place (a no-op without data parallel)."""
        ...

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full weights on the host, under the model's own names, without vocabulary padding; complete on
        rank 0 (a collective call)."""
        ...

    # ---- what RL's rollouts need (objectives/rollout.py): the layout stays hidden from them too ----------
    def fsdp_roots(self) -> list[nn.Module]:
        """The modules the trained model's FSDP2 sharding hangs from (gathered once for a rollout)."""
        ...

    def forward_only(
        self, input_ids: torch.Tensor, inputs: dict[str, Any], net: nn.Module | None = None
    ) -> Any:
        """The whole model's output for token ids and the forward's keyword `inputs`, without gradients:
        the trained model's (`net` None) or a frozen copy laid out as it is (a reference); under a pipeline
        only the rank of the last stage gets it (None elsewhere)."""
        ...

    def rollout_group(self) -> dist.ProcessGroup | None:
        """The ranks that generate a rollout together (the parts of one model copy: tensor shards and
        pipeline stages), led by the group's first rank; None: the rank alone."""
        ...

    def from_last_stage(self, stats: dict[str, float]) -> dict[str, float]:
        """Statistics as the rank holding the model's output computed them, the same keys on every rank
        (a pipeline's last stage; the rank itself otherwise)."""
        ...


@torch.no_grad()
def clip_grad_norm(
    params: Sequence[torch.Tensor],
    max_norm: float | None,
    pp_group: dist.ProcessGroup | None = None,
    counted_elsewhere: torch.Tensor | None = None,
) -> torch.Tensor:
    """Global gradient norm over all ranks' shards (DTensor grads are reduced over data and tensor parallel;
    pipeline stages add their squares over `pp_group`); clips when max_norm is set. `counted_elsewhere` is a
    parameter whose gradient another one already counts (a pipeline stage's copy of a tied embedding)."""
    grads = [p.grad for p in params if p.grad is not None and p is not counted_elsewhere]
    squares = torch.zeros((), device=grads[0].device if grads else None)
    for group in _by_mesh(grads).values():
        squares = squares + _norm(group).pow(2)
    if pp_group is not None:
        dist.all_reduce(squares, group=pp_group)
    total = squares.sqrt()
    if max_norm is not None:
        for group in _by_mesh([p for p in params if p.grad is not None]).values():
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, total, foreach=True)
    return total


def _by_mesh(tensors: list[torch.Tensor]) -> dict[Any, list[torch.Tensor]]:
    """Tensors grouped by the mesh their DTensor lives on (None: plain tensors): one norm or foreach op
    per group (expert weights live on the expert mesh, the rest on the data/tensor-parallel mesh)."""
    groups: dict[Any, list[torch.Tensor]] = {}
    for t in tensors:
        mesh = t.device_mesh if isinstance(t, DTensor) else None
        groups.setdefault(mesh, []).append(t)
    return groups


def _norm(grads: list[torch.Tensor]) -> torch.Tensor:
    total = torch.nn.utils.get_total_norm(grads, foreach=True)
    return total.full_tensor() if isinstance(total, DTensor) else total


def dp_sum(
    value: torch.Tensor, dims: ParallelDims, mesh: DeviceMesh | None, op: Any = dist.ReduceOp.SUM
) -> torch.Tensor:
    """Sum (or `op`) over all data-parallel ranks (over each dimension of a 2-D HSDP mesh in turn)."""
    dp_mesh = dims.dp_mesh(mesh)
    if dp_mesh is not None:
        for dim in range(dp_mesh.ndim):
            dist.all_reduce(value, op=op, group=dp_mesh.get_group(dim))
    return value


def gathered_state(module: nn.Module, keep: bool, device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor on the host) for each entry of `module`'s state dict, gathered one tensor at a time
    over data and tensor parallel (every rank of the tensor's mesh takes part), so no rank ever holds more
    than one gathered tensor on the device; only ranks that `keep` receive the host copies. A tensor held
    twice (tied weights) is gathered once, on every rank alike (the gathers are collectives)."""
    state = module.state_dict()  # alive throughout: the ids of its tensors stay unique
    done: dict[int, torch.Tensor] = {}  # the host copies (an empty tensor where this rank keeps none)
    for key, value in state.items():  # the same order on every rank
        original = id(value)
        if original in done:
            if keep:
                yield key, done[original]
            continue
        if isinstance(value, DTensor):
            local = value.to_local()
            if is_nf4(local):  # a 4-bit shard (whole scale blocks): gathered as the weight it computes
                local = dequantized(local)  # with; torchao's NF4 full_tensor failed one gloo run in four
                value = DTensor.from_local(
                    local, value.device_mesh, value.placements, shape=value.shape, stride=value.stride()
                )
            if local.device != device:  # offloaded shards: collectives run on the compute device
                value = DTensor.from_local(
                    local.to(device),
                    value.device_mesh,
                    value.placements,
                    shape=value.shape,
                    stride=value.stride(),
                )
            value = value.full_tensor()
        done[original] = host = value.detach().cpu() if keep else torch.empty(0)
        if keep:
            yield key, host


class PlainEngine:
    """Every layout in which one module runs the whole forward on each rank."""

    is_pipeline = False

    def __init__(
        self,
        *,
        model: nn.Module,
        inner: CausalModel,
        objective: StepObjective,
        dims: ParallelDims,
        mesh: DeviceMesh | None,
        autocast: Autocast,
        device: torch.device,
    ) -> None:
        self.model, self.inner, self.objective = model, inner, objective
        self.dims, self.mesh, self.autocast, self.device = dims, mesh, autocast, device
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.split = batch_splitter(dims, mesh, inner)  # this rank's part of each row under context parallel

    def _sums(self, batch: Any) -> dict[str, torch.Tensor]:
        if self.split is not None:
            batch = self.split(batch)
        with self.autocast():
            batch = self.objective.prepare(self.model, batch)  # e.g. a reference model's log-probs
            output = self.model(batch.input_ids, **self.objective.model_inputs(batch))
            return self.objective.loss(output, batch)

    def forward_backward(
        self, batch: Any, differentiate: Differentiate, sync: bool
    ) -> dict[str, torch.Tensor]:
        with gradient_sync(self.model, sync=sync), loss_context(self.dims):
            sums = self._sums(batch)
            differentiate(sums["loss"]).backward()
        return {k: v.detach() for k, v in sums.items()}

    @torch.no_grad()
    def eval_sums(self, batch: Any) -> dict[str, torch.Tensor]:
        with loss_context(self.dims):
            return self._sums(batch)

    def reduce_tied_grads(self) -> None:
        """Tied weights are one parameter here: nothing to sum."""

    def clip(self, max_norm: float | None) -> torch.Tensor:
        return clip_grad_norm(self.params, max_norm)

    def dp_sum(self, value: torch.Tensor) -> torch.Tensor:
        return dp_sum(value, self.dims, self.mesh)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        keep = not dist.is_initialized() or dist.get_rank() == 0
        state = dict(gathered_state(self.inner, keep, self.device))
        return strip_vocab_padding(state, self.inner.config.vocab_size)

    def fsdp_roots(self) -> list[nn.Module]:
        return [self.inner]

    @functools.cache  # noqa: B019 (one per engine, which lives as long as the run)
    def rollout_group(self) -> dist.ProcessGroup | None:
        return self.dims.model_group(self.mesh)

    @torch.no_grad()
    def forward_only(
        self, input_ids: torch.Tensor, inputs: dict[str, Any], net: nn.Module | None = None
    ) -> Any:
        return (self.model if net is None else net)(input_ids, **inputs)

    def from_last_stage(self, stats: dict[str, float]) -> dict[str, float]:
        return stats
