"""Measured activation memory: the bytes one forward leaves alive for backward, per rank.

`torch.autograd.graph.saved_tensors_hooks` sees what autograd saves, including the block inputs that torch's
non-reentrant checkpoint saves, but not what selective checkpointing keeps: its policy caches the chosen op
outputs inside a dispatch mode of its own. So the report tracks every tensor the forward creates (a dispatch
mode of ours sees each op's outputs; DTensors count their local shard), notes which module created it, and
after the forward counts the storages still alive. With no or full checkpointing this equals what the
saved-tensor hooks see (tested); with selective checkpointing it also counts the cached outputs. The
planner's activation estimate is to be checked against it.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves

Forward = Callable[[], Any]  # runs one training forward of the model, returns its output


@dataclass(frozen=True)
class HeldTensor:
    module: str  # the innermost module whose forward created it ("" for the model's own code)
    shape: tuple[int, ...]  # local shape on this rank
    nbytes: int


@dataclass
class ActivationReport:
    """What one forward keeps for backward on this rank, storage by storage."""

    tensors: list[HeldTensor] = field(default_factory=list)

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def bytes_where(self, keep: Callable[[HeldTensor], bool]) -> int:
        return sum(t.nbytes for t in self.tensors if keep(t))

    def by_module(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for t in self.tensors:
            out[t.module] = out.get(t.module, 0) + t.nbytes
        return out


def _plain(t: torch.Tensor) -> list[torch.Tensor]:
    """The tensors that own memory: a DTensor's local shard, an async collective's result, or `t` itself."""
    if not is_traceable_wrapper_subclass(t):
        return [t]
    inner = [getattr(t, name) for name in t.__tensor_flatten__()[0]]
    return [p for x in inner if isinstance(x, torch.Tensor) for p in _plain(x)]


def _storage_keys(tensors: Any) -> set[int]:
    leaves = [t for t in tree_leaves(tensors) if isinstance(t, torch.Tensor)]
    return {plain.untyped_storage().data_ptr() for t in leaves for plain in _plain(t)}


class _CreatedTensors(TorchDispatchMode):
    """Weak references to the storages of every op output, with the module running at the time (the first
    sighting of a storage names it; views of it are not counted again)."""

    def __init__(self) -> None:
        super().__init__()
        self.module_stack: list[str] = [""]
        self.storages: dict[int, tuple[weakref.ref, HeldTensor]] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        # An output that aliases an input (a view, an in-place result) owns no new memory: counted where its
        # storage was made, or not at all when that was before the forward (the batch, parameters).
        inputs = _storage_keys((args, kwargs))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                for plain in _plain(t):
                    if plain.device.type != "meta" and plain.untyped_storage().data_ptr() not in inputs:
                        self._record(plain)
        return out

    def _record(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        known = self.storages.get(key)
        if known is not None and known[0]() is not None:
            return
        self.storages[key] = (
            weakref.ref(storage),
            HeldTensor(self.module_stack[-1], tuple(t.shape), storage.nbytes()),
        )

    def alive(self, exclude: set[int]) -> dict[int, HeldTensor]:
        """Storages still alive, at their size now (FSDP2 frees gathered parameters by resizing to 0)."""
        out = {}
        for key, (ref, held) in self.storages.items():
            storage = ref()
            if storage is not None and storage.nbytes() > 0 and key not in exclude:
                out[key] = HeldTensor(held.module, held.shape, storage.nbytes())
        return out


@contextmanager
def _tracking(model: nn.Module) -> Iterator[_CreatedTensors]:
    """Record what a forward of `model` creates, attributed to modules by forward hooks."""
    created = _CreatedTensors()

    def enter(name: str) -> Callable[..., None]:
        return lambda *_: created.module_stack.append(name)

    def leave(*_: Any) -> None:  # a forward hook must return None to keep the module's output
        created.module_stack.pop()

    handles = []
    for name, module in model.named_modules():
        handles += [module.register_forward_pre_hook(enter(name)), module.register_forward_hook(leave)]
    try:
        with created:
            yield created
    finally:
        for handle in handles:
            handle.remove()


def activation_report(model: nn.Module, forward: Forward) -> ActivationReport:
    """Run `forward` (one training forward of `model`, e.g. an objective's) and measure what it keeps for
    backward (its output and the parameters excluded). No backward runs; the graph is freed before returning.
    A callable rather than a batch: the measuring tool knows nothing of batches or objectives."""
    with _tracking(model) as created:
        out = forward()
    held = created.alive(_storage_keys(out) | _storage_keys(list(model.parameters())))
    del out
    return ActivationReport(list(held.values()))
