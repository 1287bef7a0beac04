"""Save and load the whole training state with torch.distributed.checkpoint: model and optimizer as sharded
tensors (any layout in, any layout out: DCP reshards on load), plus the loop's own state as JSON and each
rank's RNG state. Collective calls: every rank takes part."""

from __future__ import annotations

import json
import shutil
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.nn.parallel import DistributedDataParallel

from shardforge.checkpoint.optim_state import load_optimizer_state, optimizer_state
from shardforge.checkpoint.store import TRAINER_STATE, commit, staging_dir, step_name
from shardforge.errors import CheckpointError


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _single() -> bool:
    """One process: DCP reads and writes everything itself (and says nothing about it)."""
    return not dist.is_initialized()


def _dcp(operation: Callable, *args: Any, **kwargs: Any) -> Any:
    """A DCP save / async_save / load; without a process group, in single-process mode, and without DCP's
    warning on every such call that it assumes one process (that is the intent here)."""
    with warnings.catch_warnings():
        if _single():
            warnings.filterwarnings("ignore", message=r"torch\.distributed is .* single process")
        return operation(*args, no_dist=_single(), **kwargs)


def _require_shared(staging: Path) -> None:
    """Every rank writes into the folder rank 0 created: output_dir must be on a filesystem all ranks share.
    All ranks learn together whether that holds, so they fail alike instead of hanging."""
    on_gpu = dist.is_initialized() and dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    missing = torch.tensor([0.0 if staging.is_dir() else 1.0], device=device)
    if dist.is_initialized():
        dist.all_reduce(missing)
    if missing.item():
        raise CheckpointError(
            f"{int(missing.item())} rank(s) cannot see {staging}, created by rank 0: output_dir must be on "
            f"a filesystem shared by all nodes (e.g. NFS or Lustre) for checkpoints"
        )


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _frozen(model: nn.Module) -> bool:
    return any(not p.requires_grad for p in model.parameters())


_WRAPPERS = ("_checkpoint_wrapped_module.", "_orig_mod.")  # name segments wrappers add (DCP drops them)


def _model_state(model: nn.Module) -> dict[str, Any]:
    """What a checkpoint holds of the model: every weight, or only the trained ones when some are frozen
    (LoRA, freeze tuning): the frozen base is read again from model.path on resume and on export. A tied
    weight is frozen under both its names."""
    state = get_model_state_dict(model)
    if not _frozen(model):
        return state
    frozen = set()
    for name, param in model.named_parameters(remove_duplicate=False):
        if not param.requires_grad:
            name = name.removeprefix("module.") if isinstance(model, DistributedDataParallel) else name
            for segment in _WRAPPERS:
                name = name.replace(segment, "")
            frozen.add(name)
    return {k: v for k, v in state.items() if k not in frozen}


def trained_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """A plain (unsharded) model's state dict, less the frozen weights (as `_model_state` keeps it)."""
    trained = {n for n, p in model.named_parameters(remove_duplicate=False) if p.requires_grad}
    state = model.state_dict()
    return {k: v for k, v in state.items() if k in trained} if _frozen(model) else state


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


class Checkpointer:
    """Writes checkpoints under `root` and commits each atomically once every rank's part is on disk.

    With `async_save`, DCP copies the state to host memory and writes it from a background thread (over a
    gloo group of its own, so its collectives never interleave with training's), and training continues;
    the commit happens when the write is complete: before the next save, or at `wait()`. A crash before
    that leaves an uncommitted staging folder, and resume uses the previous checkpoint."""

    def __init__(self, root: Path, keep: int | None, async_save: bool = False) -> None:
        self.root, self.keep, self.async_save = root, keep, async_save
        self.group = dist.new_group(backend="gloo") if async_save and dist.is_initialized() else None
        self._pending: tuple[Future, Path, int] | None = None

    def save(
        self,
        step: int,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        state: dict,
        extra_files: dict[str, str] | None = None,
        phase: Callable[[str], None] = lambda _: None,
    ) -> Path:
        """Save `step` (collective). `state` is the loop's JSON-able state (written by rank 0);
        `extra_files` are small text files kept beside it (the resolved config, so that a checkpoint can
        be exported on its own). Returns the folder the checkpoint has (or will have, when async)."""
        self.wait()  # one save in flight at a time
        rank = _rank()
        staging = staging_dir(self.root, step)
        phase(f"saving checkpoint {step_name(step)} (torch.distributed.checkpoint collectives)")
        if rank == 0:
            shutil.rmtree(staging, ignore_errors=True)
            staging.mkdir(parents=True)
        _barrier()
        _require_shared(staging)
        both = {"model": _model_state(model), "optim": optimizer_state(model, optimizer)}
        torch.save(_rng_state(), staging / f"rng-rank{rank}.pt")
        if rank == 0:
            for name, text in (extra_files or {}).items():
                (staging / name).write_text(text)
            (staging / TRAINER_STATE).write_text(json.dumps(state, indent=1))
        if self.async_save:
            future = _dcp(dcp.async_save, both, checkpoint_id=staging, process_group=self.group)
            self._pending = (future, staging, step)
            return self.root / step_name(step)
        _dcp(dcp.save, both, checkpoint_id=staging)
        phase(f"committing checkpoint {step_name(step)} (rank 0 renames, the others wait)")
        return self._commit(staging, step)

    def wait(self) -> Path | None:
        """Finish and commit the save in flight, if any (collective)."""
        if self._pending is None:
            return None
        future, staging, step = self._pending
        self._pending = None
        future.result()
        return self._commit(staging, step)

    def _commit(self, staging: Path, step: int) -> Path:
        _barrier()  # every rank's files are written before rank 0 lists and commits them
        final = commit(staging, step, self.keep) if _rank() == 0 else self.root / step_name(step)
        _barrier()
        return final


def read_trainer_state(folder: Path) -> dict:
    return json.loads((folder / TRAINER_STATE).read_text())


def load_checkpoint(folder: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Load model and optimizer (resharded onto this run's layout) and this rank's RNG state when the world
    size is unchanged; returns the loop's saved state."""
    both = {"model": _model_state(model), "optim": optimizer_state(model, optimizer)}
    _dcp(dcp.load, both, checkpoint_id=folder)
    # Without the frozen weights the state is partial by design: the rest came from model.path.
    set_model_state_dict(model, both["model"], options=StateDictOptions(strict=not _frozen(model)))
    load_optimizer_state(model, optimizer, both["optim"])
    state = read_trainer_state(folder)
    world = dist.get_world_size() if dist.is_initialized() else 1
    rng_file = folder / f"rng-rank{_rank()}.pt"
    if state.get("world_size") == world and rng_file.is_file():
        rng = torch.load(rng_file, weights_only=True)
        torch.set_rng_state(rng["cpu"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
    return state


def load_model_weights(folder: Path, model: nn.Module) -> None:
    """Only the weights, into a plain (unsharded) model in one process: for export."""
    state = {"model": trained_state(model)}
    _dcp(dcp.load, state, checkpoint_id=folder)  # export runs in one process: no group
    model.load_state_dict(state["model"], strict=not _frozen(model))
