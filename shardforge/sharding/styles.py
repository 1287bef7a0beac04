"""ParallelStyles torch does not ship: a module run whole on every TP rank with DTensor parameters, and the
key / value projections of grouped-query attention under tp above the kv heads."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, distribute_module
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, PrepareModuleInput


class ReplicateParallel(ParallelStyle):
    """Parameters replicated over the TP mesh; the first input (a local tensor laid out as `input_layout`,
    or a DTensor) is made whole (all-gathered if split) and the output is a plain local tensor.

    Used for norms outside sequence parallel. Making their parameters DTensors too keeps every parameter of
    a TP model on one mesh, so one optimizer, clipping and FSDP path serves them all; their gradients are
    identical on every TP rank because their inputs and output gradients are.
    """

    def __init__(self, input_layout: Placement | None = None) -> None:
        super().__init__()
        self.input_layout = input_layout or Replicate()

    def _prepare_input(self, module: nn.Module, inputs: tuple[Any, ...], mesh: DeviceMesh) -> tuple[Any, ...]:
        first = inputs[0]
        if not isinstance(first, DTensor):
            first = DTensor.from_local(first, mesh, (self.input_layout,), run_check=False)
        if first.placements != (Replicate(),):
            first = first.redistribute(placements=(Replicate(),))
        return (first, *inputs[1:])

    @staticmethod
    def _prepare_output(module: nn.Module, output: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
        return output.to_local() if isinstance(output, DTensor) else output

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(
            module, device_mesh, input_fn=self._prepare_input, output_fn=self._prepare_output
        )


class WholeSequenceParallel(ParallelStyle):
    """A module that computes on plain tensors over the whole sequence on every TP rank (a mixture of
    experts: routing needs every token and the experts are not split by TP): the parameters of the children
    named in `replicated` become DTensors replicated over the TP mesh (read locally in the module's code),
    the first input is all-gathered from `stream` (the residual stream's layout; a DTensor is taken as it
    is) and the output cut back to it. Every rank then computes the same values and receives the same
    output gradients (the cut's backward all-gathers them), so the replicated parameters' gradients agree
    across ranks, as a DTensor's must."""

    def __init__(self, stream: Placement, replicated: tuple[str, ...]) -> None:
        super().__init__()
        self.stream, self.replicated = stream, replicated

    def _partition(self, name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        if name not in self.replicated:
            return
        for key, param in list(module.named_parameters(recurse=False)):
            dt = DTensor.from_local(param.detach(), mesh, (Replicate(),), run_check=False)
            module.register_parameter(key, nn.Parameter(dt, requires_grad=param.requires_grad))

    def _prepare_input(self, module: nn.Module, inputs: tuple[Any, ...], mesh: DeviceMesh) -> tuple[Any, ...]:
        x = inputs[0]  # a DTensor from a sequence-parallel norm, or a local tensor laid out as `stream`
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, mesh, (self.stream,), run_check=False)
        return (x.redistribute(placements=(Replicate(),)).to_local(), *inputs[1:])

    def _prepare_output(self, module: nn.Module, output: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
        if self.stream == Replicate():
            return output
        whole = DTensor.from_local(output, mesh, (Replicate(),), run_check=False)
        return whole.redistribute(placements=(self.stream,)).to_local()

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        # Not distribute_module: it would replicate every other parameter and buffer too (the shared
        # expert has styles of its own; the router's bias stays a plain tensor).
        for name, child in module.named_modules():
            self._partition(name, child, device_mesh)
        module.register_forward_pre_hook(lambda m, inputs: self._prepare_input(m, inputs, device_mesh))
        module.register_forward_hook(lambda m, inputs, out: self._prepare_output(m, out, device_mesh))
        return module


class GatherStream(PrepareModuleInput):
    """The attention / MLP input all-gathered from the sequence-split stream (sequence parallel). A type of
    its own so `apply_tensor_parallel` can keep that input sharded for the backward (sharding/regather.py)."""


class KVColwiseParallel(ColwiseParallel):
    """The key / value projections split by heads, as ColwiseParallel splits them (tp divides the kv heads).
    A type of its own so the planner knows these weights are whole on every rank when tp exceeds the kv heads
    (`ReplicatedKVHeads`)."""


class ReplicatedKVHeads(ParallelStyle):
    """Key / value projections when tp exceeds the kv heads (grouped-query attention, Megatron's kv-head
    replication): the weights are replicated, every rank computes all kv heads and keeps the one its query
    heads read (rank r of tp holds query heads r*nq/tp...; with tp = g x kv, kv head r // g). The kept slice's
    gradient leaves as a Partial DTensor (this rank's share of the whole), so the replicated weights'
    gradients are the sum over ranks: each replica's use counted once, as in one process."""

    def __init__(self, kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.kv_heads, self.head_dim = kv_heads, head_dim

    @staticmethod
    def _prepare_input(module: nn.Module, inputs: tuple[Any, ...], mesh: DeviceMesh) -> tuple[Any, ...]:
        x = inputs[0]  # the attention input: whole on every rank (gathered under sequence parallel)
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, mesh, (Replicate(),), run_check=False)
        return (x, *inputs[1:])

    def _prepare_output(self, module: nn.Module, output: DTensor, mesh: DeviceMesh) -> torch.Tensor:
        whole = output.to_local(grad_placements=(Partial(),))
        group = mesh.size() // self.kv_heads  # ranks per kv head
        head = mesh.get_local_rank() // group
        return whole[..., head * self.head_dim : (head + 1) * self.head_dim].contiguous()

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(
            module, device_mesh, input_fn=self._prepare_input, output_fn=self._prepare_output
        )


class LocalReplicate(ParallelStyle):
    """A module whose code we do not own (transformers' vision towers) run whole on every TP rank: its
    parameters become DTensors replicated over the TP mesh (so every parameter of a TP model is on one mesh,
    for the optimizer, clipping and FSDP2), and while it runs each is shadowed by its local tensor
    (`to_local`, differentiable: the gradient comes back to the DTensor, replicated), so its code sees plain
    tensors. Every rank computes the same values from the same inputs, so the gradients agree across ranks,
    as a replicated DTensor's must."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        held: list[tuple[nn.Module, str]] = []
        for sub in module.modules():
            for name, param in list(sub._parameters.items()):
                if param is None or isinstance(param, DTensor):
                    continue
                local = DTensor.from_local(param.data, device_mesh, [Replicate()], run_check=False)
                sub._parameters[name] = nn.Parameter(local, requires_grad=param.requires_grad)
                held.append((sub, name))

        def shadow(_module: nn.Module, _args: Any) -> None:
            for sub, name in held:
                param = sub._parameters[name]  # FSDP2 may have swapped in its unsharded DTensor
                sub.__dict__[name] = param.to_local() if isinstance(param, DTensor) else param

        def unshadow(_module: nn.Module, _args: Any, _output: Any) -> None:
            for sub, name in held:
                sub.__dict__.pop(name, None)

        module.register_forward_pre_hook(shadow)
        module.register_forward_hook(unshadow)
        return module
