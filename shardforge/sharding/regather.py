"""Sequence parallel's gathered inputs kept sharded for the backward, as Megatron keeps them.

Under sequence parallel each attention / MLP input is all-gathered from the sequence-split stream; the
matmuls (and adapters) that read it would save the whole [s, h] copy for their weight gradients. Here the
copy is saved as a handle on the 1/tp shard instead, and gathered again when the backward first needs it
(once for all the matmuls that read it), so the forward keeps s/t rows, not s.

Installed with saved-tensor hooks around the module's forward, and only where no checkpointing wraps the
block (a checkpoint's own saved-tensor hooks must see what it saves; `apply_tensor_parallel` decides).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks
from torch.distributed.tensor import DTensor, Replicate


def _storage(t: torch.Tensor) -> int:
    local = t.to_local() if isinstance(t, DTensor) else t
    return local.untyped_storage().data_ptr()


class _Gathered:
    """One gathered input: its shard, and the whole copy while the backward uses it (dropped after the last
    of the saved tensors that point at it is unpacked)."""

    def __init__(self, shard: DTensor) -> None:
        self.shard = shard
        self.uses = 0
        self.whole: torch.Tensor | None = None

    def local(self) -> torch.Tensor:
        if self.whole is None:
            with torch.no_grad():
                self.whole = self.shard.redistribute(placements=(Replicate(),)).to_local()
        whole = self.whole
        self.uses -= 1
        if self.uses == 0:
            self.whole = None
        return whole


class _Saved:
    """A saved tensor that is a view of a gathered input: rebuilt from the whole copy on unpack."""

    def __init__(self, gathered: _Gathered, t: torch.Tensor) -> None:
        local = t.to_local() if isinstance(t, DTensor) else t
        self.gathered = gathered
        self.view = (local.size(), local.stride(), local.storage_offset())
        self.spec = (t.device_mesh, t.placements, t.shape, t.stride()) if isinstance(t, DTensor) else None

    def unpack(self) -> torch.Tensor:
        size, stride, offset = self.view
        local = self.gathered.local().as_strided(size, stride, offset)
        if self.spec is None:
            return local
        mesh, placements, shape, stride = self.spec
        return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)


def keep_input_sharded(module: nn.Module) -> None:
    """`module`'s first input arrives sequence-split (a Shard(1) DTensor) and is gathered by its input
    style (a pre-hook registered before this one): tensors its forward saves that are that gathered copy
    are saved as its shard."""
    state: dict[str, Any] = {}

    def pack(t: torch.Tensor) -> Any:
        gathered = state["gathered"] if state.get("key") == _storage(t) else None
        if gathered is None:
            return t
        gathered.uses += 1
        return _Saved(gathered, t)

    def unpack(saved: Any) -> torch.Tensor:
        return saved.unpack() if isinstance(saved, _Saved) else saved

    def enter(mod: nn.Module, args: tuple) -> None:
        x = args[0]
        if isinstance(x, DTensor) and x.placements == (Replicate(),) and state.get("shard") is not None:
            state["key"], state["gathered"] = _storage(x), _Gathered(state.pop("shard"))
        hooks = saved_tensors_hooks(pack, unpack)
        hooks.__enter__()
        state["hooks"] = hooks

    def leave(mod: nn.Module, args: tuple, out: Any) -> None:
        state.pop("hooks").__exit__(None, None, None)
        for key in ("key", "gathered"):  # the handles the saved tensors hold live on; this forward's are done
            state.pop(key, None)

    def remember_shard(mod: nn.Module, args: tuple) -> None:
        x = args[0]
        state["shard"] = x if isinstance(x, DTensor) and x.placements != (Replicate(),) else None

    module.register_forward_pre_hook(remember_shard, prepend=True)  # before the input style gathers it
    module.register_forward_pre_hook(enter)  # after it
    module.register_forward_hook(leave)
