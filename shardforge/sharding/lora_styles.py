"""Tensor-parallel styles for a linear layer that carries a LoRA adapter: the adapter is split as its base is.

A colwise base (weight split by output rows) splits B and the DoRA magnitude by output rows too and keeps A
whole: x A^T is computed whole on every rank and B adds this rank's output columns. A rowwise base (weight
split by input columns) splits A by input columns and keeps B and the magnitude whole: x A^T is a partial
sum, reduced with the base's output. torch's own styles would split every parameter by rows (colwise) or
replicate the adapter (rowwise), and stumble on the layer's dropout child.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from shardforge.sharding.styles import ReplicatedKVHeads

ADAPTER = "lora_A"  # a module with this parameter carries an adapter

COLWISE: dict[str, Placement] = {
    "weight": Shard(0),
    "bias": Shard(0),
    "lora_A": Replicate(),
    "lora_B": Shard(0),
    "lora_magnitude": Shard(0),
}
ROWWISE: dict[str, Placement] = {
    "weight": Shard(1),
    "bias": Replicate(),
    "lora_A": Shard(1),
    "lora_B": Replicate(),
    "lora_magnitude": Replicate(),
}


def _distribute(module: nn.Module, mesh: DeviceMesh, placements: dict[str, Placement], src: int | None):
    if not hasattr(module, ADAPTER):  # the layer's children (its dropout) hold nothing
        return
    for name, param in list(module.named_parameters(recurse=False)):
        shard = distribute_tensor(param, mesh, [placements[name]], src_data_rank=src)
        module.register_parameter(name, nn.Parameter(shard, requires_grad=param.requires_grad))


class LoRAColwiseParallel(ColwiseParallel):
    def _partition_linear_fn(self, name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        _distribute(module, device_mesh, COLWISE, self.src_data_rank)


class LoRARowwiseParallel(RowwiseParallel):
    def _partition_linear_fn(self, name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        _distribute(module, device_mesh, ROWWISE, self.src_data_rank)


def for_adapter(style: ParallelStyle) -> ParallelStyle:
    """The same style (its layouts kept) for a linear that carries an adapter."""
    if isinstance(style, ReplicatedKVHeads):  # every parameter replicated: the adapter's too
        return style
    kinds = ((ColwiseParallel, LoRAColwiseParallel), (RowwiseParallel, LoRARowwiseParallel))
    kind = next((adapted for base, adapted in kinds if isinstance(style, base)), None)
    if kind is None:
        raise NotImplementedError(f"no adapter-aware version of {type(style).__name__}")
    adapted = kind.__new__(kind)
    adapted.__dict__.update(style.__dict__)
    return adapted
