"""Optimizer state in one checkpoint format for every layout: torch's `get_optimizer_state_dict` layout
({"state": {fqn: {exp_avg, exp_avg_sq, step}}, "param_groups": [{..., "params": [fqn, ...]}]}), with each
state tensor laid out like its parameter (a DTensor shard under FSDP2/TP, a whole tensor otherwise), stored
flattened to one key per parameter and value.

torch's helpers cover plain optimizers over the model's parameters. Two of ours are not: ZeRO-1
(`ZeroRedundancyOptimizer`: each rank holds whole states for the parameters assigned to it) and
`OffloadedAdamW` (states of host copies of the local shards). For those, this module builds the same format
itself, so a checkpoint of any layout resumes on any other: DCP stores whole tensors once, shards once, and
reads back whatever pieces the new layout asks for.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor

from shardforge.parallel.data_parallel import unwrap
from shardforge.parallel.memory import local_tensor
from shardforge.parallel.offload import OffloadedAdamW

_WRAPPERS = ("_checkpoint_wrapped_module.", "_orig_mod.", "module.")
FORMAT = 2  # 1: torch's nested layout (before pipeline parallel); 2: one key per parameter and value


def _fqn(name: str) -> str:
    for wrapper in _WRAPPERS:
        name = name.replace(wrapper, "")
    return name


def _names(model: nn.Module) -> dict[int, str]:
    return {id(p): _fqn(name) for name, p in model.named_parameters()}


def _adam_state(like: torch.Tensor, state: dict) -> dict:
    """This parameter's AdamW state, or zeros of the right layout to load into (before the first step)."""
    if state:
        return dict(state)
    step_device = local_tensor(like).device
    return {
        "step": torch.zeros((), dtype=torch.float32, device=step_device),
        "exp_avg": torch.zeros_like(like),
        "exp_avg_sq": torch.zeros_like(like),
    }


def _groups(param_groups: list[dict], names: list[list[str]]) -> list[dict]:
    return [
        {**{k: v for k, v in g.items() if k != "params"}, "params": n}
        for g, n in zip(param_groups, names, strict=True)
    ]


def _zero1_pairs(model: nn.Module, opt: ZeroRedundancyOptimizer) -> Iterator[tuple[str, torch.Tensor]]:
    """(fqn, parameter) for the parameters whose states live on this rank."""
    names = _names(model)
    for group in opt.optim.param_groups:
        for p in group["params"]:
            yield names[id(p)], p


def _offload_pairs(model: nn.Module, opt: OffloadedAdamW) -> Iterator[tuple[str, torch.Tensor, torch.Tensor]]:
    """(fqn, device parameter, host master) for every parameter."""
    names = _names(model)
    for p, master in zip(opt.device_params, opt.masters, strict=True):
        yield names[id(p)], p, master


def _as_param_layout(value: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """A host state tensor of a local shard, shown with the parameter's DTensor layout (for resharding)."""
    if isinstance(param, DTensor) and value.ndim:
        return DTensor.from_local(
            value,
            param.device_mesh,
            param.placements,
            run_check=False,
            shape=param.shape,
            stride=param.stride(),
        )
    return value


def _common_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """The optimizer's state in the common format (also the template that a load fills in)."""
    names = _names(model)
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        state = {
            fqn: _adam_state(p, optimizer.optim.state.get(p, {})) for fqn, p in _zero1_pairs(model, optimizer)
        }
        groups = [[names[id(p)] for p in g["params"]] for g in optimizer.param_groups]
        return {"state": state, "param_groups": _groups(optimizer.param_groups, groups)}
    if isinstance(optimizer, OffloadedAdamW):
        state, master_names = {}, {}
        for fqn, p, master in _offload_pairs(model, optimizer):
            host = _adam_state(master, optimizer.state.get(master, {}))
            state[fqn] = {k: _as_param_layout(v, p) for k, v in host.items()}
            master_names[id(master)] = fqn
        groups = [[master_names[id(m)] for m in g["params"]] for g in optimizer.param_groups]
        return {"state": state, "param_groups": _groups(optimizer.param_groups, groups)}
    return get_optimizer_state_dict(model, optimizer)


def _stored_name(model: nn.Module) -> Callable[[str], str]:
    """A pipeline stage's copy of a tied embedding (its LM head) is stored as the embedding it equals, so a
    checkpoint has one optimizer state for it whatever the layout."""
    if unwrap(model).untied_copy:
        return lambda fqn: "embed_tokens.weight" if fqn == "lm_head.weight" else fqn
    return lambda fqn: fqn


def optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """The optimizer's state as DCP stores it: one key per parameter and value (`state.<fqn>.<name>`,
    `param_groups.<fqn>.<hyperparameter>`), so the entries of ranks that hold different parameters (pipeline
    stages) merge into one checkpoint, and any layout reads back the entries of the parameters it holds."""
    common, stored = _common_state(model, optimizer), _stored_name(model)
    flat = {}
    for fqn, values in common["state"].items():
        flat.update({f"state.{stored(fqn)}.{k}": v for k, v in values.items()})
    for group in common["param_groups"]:
        hyper = {k: v for k, v in group.items() if k != "params"}
        for fqn in group["params"]:
            flat.update({f"param_groups.{stored(fqn)}.{k}": v for k, v in hyper.items()})
    return flat


def load_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, loaded: dict) -> None:
    """Put a state as returned by `optimizer_state` (and filled in by DCP) into the optimizer."""
    template, stored = _common_state(model, optimizer), _stored_name(model)
    seen: set[str] = set()
    state = {}
    for fqn, values in template["state"].items():
        entry = {k: loaded[f"state.{stored(fqn)}.{k}"] for k in values}
        if stored(fqn) in seen:  # the same stored entry feeds two parameters: each needs its own tensors
            entry = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in entry.items()}
        seen.add(stored(fqn))
        state[fqn] = entry
    groups = [
        {
            **{k: loaded[f"param_groups.{stored(g['params'][0])}.{k}"] for k in g if k != "params"},
            "params": g["params"],
        }
        for g in template["param_groups"]
    ]
    _set_common_state(model, optimizer, {"state": state, "param_groups": groups})


def _set_common_state(model: nn.Module, optimizer: torch.optim.Optimizer, loaded: dict) -> None:
    if isinstance(optimizer, (ZeroRedundancyOptimizer, OffloadedAdamW)):
        for group, saved in zip(optimizer.param_groups, loaded["param_groups"], strict=True):
            group.update({k: v for k, v in saved.items() if k != "params"})
        if isinstance(optimizer, ZeroRedundancyOptimizer):
            for fqn, p in _zero1_pairs(model, optimizer):
                optimizer.optim.state[p] = loaded["state"][fqn]
            for local, group in zip(optimizer.optim.param_groups, optimizer.param_groups, strict=False):
                local.update({k: v for k, v in group.items() if k != "params"})
        else:
            for fqn, _, master in _offload_pairs(model, optimizer):
                optimizer.state[master] = {k: local_tensor(v) for k, v in loaded["state"][fqn].items()}
        return
    set_optimizer_state_dict(model, optimizer, loaded)
