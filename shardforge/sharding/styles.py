"""A ParallelStyle torch does not ship: a module run whole on every TP rank, with DTensor parameters."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, distribute_module
from torch.distributed.tensor.parallel import ParallelStyle


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
