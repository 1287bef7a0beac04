"""parallelize(): apply a run's layout to a built model, in the one fixed order, and return its Engine.

The order: tensor (+ sequence) parallel first, since it swaps parameters for DTensors that the later wrappers
take as they are; expert parallel next (it keeps this rank's experts, as DTensors sharded over ep), then
context parallel (the model's attention over the sequence split across the cp group).
Activation checkpointing wraps whole (TP-sharded) blocks: `full` recomputation repeats their TP collectives
(in the same order on every rank), `selective` keeps their outputs. Compile sees the final
block code. PPO's separate critic model, a submodule of the policy, gets the same treatment. Pipeline
stages are then cut over the wrapped blocks. Data parallel comes last: DDP wraps the model, or FSDP2 shards
the (TP) parameters over the data-parallel mesh dims, with one root per pipeline stage.
Under pipeline parallel the model given here is already pruned to this rank's stages (on the meta device,
before its weights existed).
"""

from __future__ import annotations

import datetime

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from shardforge.config.schema import Config
from shardforge.dtypes import PRECISION_DTYPES
from shardforge.parallel.activation_ckpt import apply_activation_checkpointing
from shardforge.parallel.context_parallel import apply_context_parallel
from shardforge.parallel.data_parallel import apply_data_parallel, fully_shard_frozen, unwrap
from shardforge.parallel.dims import ParallelDims
from shardforge.parallel.engine import Autocast, Engine, PlainEngine, StepObjective
from shardforge.parallel.expert_parallel import apply_expert_parallel
from shardforge.parallel.pipeline_plan import PipelinePlan
from shardforge.parallel.tensor_parallel import apply_tensor_parallel


def parallelize(
    model: nn.Module,
    dims: ParallelDims,
    mesh: DeviceMesh | None,
    config: Config,
    plan: PipelinePlan | None,
    objective: StepObjective,
    autocast: Autocast,
    device: torch.device,
) -> Engine:
    parallel, precision = config.parallel, config.train.precision
    # PPO's separate critic (a submodule: `model.critic`) is laid out as the policy is: tensor parallel with
    # its own plan, checkpointed and compiled blocks, and FSDP2 units of its own (data_parallel.py). Expert,
    # context and pipeline parallel are refused with it (planner/layout.py: check_critic).
    critic = model.critic
    towers = (model,) if critic is None else (model, critic)
    for net in towers:
        apply_tensor_parallel(net, dims, mesh, parallel)
    experts_mesh = apply_expert_parallel(model, dims, mesh)
    apply_context_parallel(model, dims, mesh, parallel.cp_mode)
    for net in towers:
        sequence_parallel = parallel.sequence_parallel and dims.tp > 1
        apply_activation_checkpointing(net, parallel.activation_checkpoint, sequence_parallel)
        if config.train.compile:
            for block in net.blocks():
                block.compile()
    if plan is None:
        wrapped = apply_data_parallel(model, dims, mesh, parallel, precision, device, None, experts_mesh)
        return PlainEngine(
            model=wrapped, inner=unwrap(wrapped), objective=objective, dims=dims, mesh=mesh,
            autocast=autocast, device=device,
        )  # fmt: skip
    from shardforge.parallel.pipeline import PipelineEngine  # torch's pipelining costs 0.4 s to import

    engine = PipelineEngine(
        plan=plan,
        model=model,
        objective=objective,
        dims=dims,
        mesh=mesh,
        device=device,
        autocast=autocast,
        stream_dtype=_stream_dtype(model, dims, precision),
        sequence_parallel=parallel.sequence_parallel,
        timeout=datetime.timedelta(minutes=parallel.timeout_minutes),
    )
    stages = list(engine.stages.values())
    apply_data_parallel(model, dims, mesh, parallel, precision, device, stages, experts_mesh)
    engine.params = [p for p in model.parameters() if p.requires_grad]
    return engine


def lay_out_frozen(
    model: nn.Module, dims: ParallelDims, mesh: DeviceMesh | None, config: Config, device: torch.device
) -> nn.Module:
    """A model that only runs forward beside the trained one (a reference model), sharded as the trained
    one is: tensor parallel with the same plan, expert parallel, FSDP2 over the same data-parallel mesh
    (parameters gathered per block for its forward, freed after), replicated under DDP; no gradients, no
    optimizer state. Not for a pipeline: its stages run chunks of the batch on parts of the model."""
    parallel = config.parallel
    apply_tensor_parallel(model, dims, mesh, parallel)
    experts_mesh = apply_expert_parallel(model, dims, mesh)
    dp_mesh = dims.dp_mesh(mesh)
    if dims.sharded and dp_mesh is not None:
        fully_shard_frozen(model, dims, dp_mesh, parallel, config.train.precision, device, experts_mesh)
    return model


def _stream_dtype(model: nn.Module, dims: ParallelDims, precision: str) -> torch.dtype:
    """The dtype of the residual stream between pipeline stages: FSDP2's compute dtype under mixed
    precision, else the weights' (autocast leaves the stream in the weights' dtype)."""
    if dims.sharded and precision != "fp32":
        return PRECISION_DTYPES[precision]
    return next(model.parameters()).dtype
