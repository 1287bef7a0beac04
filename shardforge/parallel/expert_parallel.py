"""Expert parallel: the experts of every MoE layer split over `ep` ranks, tokens sent to their experts' rank
and back with all-to-all (autograd through torch's functional collectives).

The ep ranks are a view of the ranks that already split the data (dp_shard x cp): the mesh dimension they
occupy is unflattened into (edp, ep), ep innermost, so an ep group is neighbouring ranks and edp the ranks
that hold the same experts. Expert weights become DTensors sharded over ep on dimension 0 (the expert
index; replicated over tp as tensor parallel left them), so checkpoints hold whole [E, ...] tensors and
resume on any ep; FSDP2 then shards them over edp (`data_parallel.py`), and their gradients are scaled by
1 / ep so that edp's average equals the average over all data-parallel ranks. A layer routes its own tokens,
sorts the choices by expert, sends each ep rank the rows of its experts, runs its own experts as one grouped
matmul over what it received, and sends the results back, where the router weights apply.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from shardforge.errors import ConfigError
from shardforge.models.moe import Dispatch, Experts, moe_layers
from shardforge.parallel.dims import ParallelDims

EXPERT_PARAMS = ("gate_up_proj", "down_proj")


def expert_mesh(dims: ParallelDims, mesh: DeviceMesh | None) -> DeviceMesh | None:
    """The job's mesh with the data-splitting dimension (dp_shard, or dp_shard x cp flattened) unflattened
    into (edp, ep); None without expert parallel."""
    if dims.ep == 1 or mesh is None:
        return None
    sizes = (dims.dp_shard * dims.cp // dims.ep, dims.ep)
    # By index, not name: torch 2.11's `_unflatten` refuses a dimension given by a name it has.
    if dims.cp == 1:
        return mesh._unflatten(mesh.mesh_dim_names.index("dp_shard"), sizes, ("edp", "ep"))
    names = tuple(n for n in ("dp_shard", "cp") if dims.degrees()[n] > 1)
    flat = mesh[names] if len(names) > 1 else mesh[names[0]]
    if len(names) > 1:
        flat = flat._flatten("_".join(names))
    return flat._unflatten(0, sizes, ("edp", "ep"))


def check_expert_parallel(cfg, dims: ParallelDims) -> None:
    """The shape rules ep must satisfy, before any process group exists."""
    if dims.ep == 1:
        return
    experts = cfg.num_experts
    if not experts:
        raise ConfigError(
            f"parallel.ep={dims.ep}: the model ({cfg.family}) has no experts to split; expert parallel is "
            f"for mixture-of-experts models (mixtral, qwen2_moe, qwen3_moe): keep parallel.ep=1"
        )
    if dims.cp > 1 and dims.tp > 1:
        raise ConfigError(
            f"parallel.ep={dims.ep} with both cp={dims.cp} and tp={dims.tp}: not supported (expert parallel "
            f"composes with either); drop one of them"
        )
    if experts % dims.ep:
        valid = [d for d in range(1, experts + 1) if experts % d == 0 and (dims.dp_shard * dims.cp) % d == 0]
        raise ConfigError(
            f"parallel.ep={dims.ep} does not divide the model's {experts} experts (valid here: "
            f"{', '.join(map(str, valid))})"
        )


def apply_expert_parallel(model: nn.Module, dims: ParallelDims, mesh: DeviceMesh | None) -> DeviceMesh | None:
    """Keep this rank's experts and route tokens through the ep group; returns the expert mesh (FSDP2
    shards the experts over its edp dimension), None without expert parallel."""
    emesh = expert_mesh(dims, mesh)
    if emesh is None:
        return None
    names = ("ep", "tp") if dims.tp > 1 else ("ep",)
    target = emesh[names] if len(names) > 1 else emesh["ep"]
    placements = (Shard(0), *(Replicate() for _ in names[1:]))
    rank, group = emesh.get_local_rank("ep"), emesh["ep"].get_group()
    for layer in moe_layers(model):
        experts = layer.experts
        for name in EXPERT_PARAMS:
            param = getattr(experts, name)
            whole = param.to_local() if isinstance(param, DTensor) else param  # replicated over tp: whole
            per_rank = whole.shape[0] // dims.ep
            mine = whole.detach()[rank * per_rank : (rank + 1) * per_rank].clone()
            sharded = DTensor.from_local(mine, target, placements, run_check=False, shape=whole.shape,
                                         stride=whole.stride())  # fmt: skip
            experts.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))
        experts.exchange = partial(exchange, group=group, ep=dims.ep)
        # An expert's gradient sums the tokens of the whole ep group, each scaled like any rank's loss by
        # dp x cp / the global count; data parallel then averages it over edp = dp x cp / ep ranks. The
        # 1 / ep makes that the average over all dp x cp ranks, as for every other parameter.
        experts.grad_scale = 1.0 / dims.ep
    return emesh


def exchange(experts: Experts, rows: torch.Tensor, dispatch: Dispatch, group, ep: int) -> torch.Tensor:
    """Rows sorted by (global) expert -> their experts' outputs, in the same order: each ep rank's share
    goes there (all-to-all with the per-expert counts first, so every rank knows what it receives), is
    re-sorted by local expert, run, and returned."""
    local = dispatch.counts.numel() // ep
    send = dispatch.counts.view(ep, local)  # per destination rank, per its expert
    received = funcol.all_to_all_single(send.reshape(-1), None, None, group).view(ep, local)
    sizes = torch.cat([send.sum(1), received.sum(1)]).tolist()  # the one host sync: split sizes
    sizes_out, sizes_in = sizes[:ep], sizes[ep:]
    arrived = funcol.all_to_all_single(rows, sizes_in, sizes_out, group)  # by source, then expert
    expert_of = torch.arange(local, device=rows.device).repeat(ep)
    expert_of = expert_of.repeat_interleave(received.reshape(-1), output_size=sum(sizes_in))
    order = torch.argsort(expert_of, stable=True)
    ends = torch.cumsum(received.sum(0), 0).to(torch.int32)
    done = experts.run(arrived[order], ends)
    back = torch.empty_like(done).index_copy(0, order, done)  # source order again
    return funcol.all_to_all_single(back, sizes_out, sizes_in, group)
