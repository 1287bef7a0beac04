"""`kept_unsharded` (parallel/data_parallel.py) is the one function that reaches into FSDP2's private state
(RL rollouts keep the policy gathered through generation and scoring). If torch renames or changes what it
uses, this fails here, loudly, instead of a rollout silently gathering per forward."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

from shardforge.parallel.data_parallel import kept_unsharded


def _sharded(x: nn.Module) -> bool:
    return all(isinstance(p, DTensor) for p in x.parameters())


def test_the_private_fsdp_state_it_uses_is_there():
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

    assert callable(FSDPModule._get_fsdp_state) and callable(FSDPState._lazy_init)
    assert "post_forward_mesh_info" in FSDPParamGroup.__init__.__code__.co_names
    names = FSDPState.__init__.__code__.co_names  # torch 2.13+: a list; 2.11/2.12: one group or None
    assert "_fsdp_param_groups" in names or "_fsdp_param_group" in names


def test_units_stay_gathered_through_forwards_and_are_resharded_after(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        torch.manual_seed(0)
        model, critic = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), nn.Linear(4, 1)
        for unit in (model[0], model[1], critic):
            fully_shard(unit, mesh=mesh)
        fully_shard(model, mesh=mesh)
        x = torch.ones(2, 4)
        expected = model(x)
        assert _sharded(model) and _sharded(critic)
        with kept_unsharded([model], skip=[critic]) as seconds:
            assert seconds >= 0.0 and not any(isinstance(p, DTensor) for p in model.parameters())
            assert torch.equal(model(x), expected)
            assert not any(isinstance(p, DTensor) for p in model.parameters())  # no reshard after forward
            assert _sharded(critic)  # skipped
        assert _sharded(model)
        with kept_unsharded([nn.Linear(2, 2)]) as seconds:  # no FSDP2 units: a no-op
            assert seconds == 0.0
    finally:
        dist.destroy_process_group()
