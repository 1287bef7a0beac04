"""`shardforge train`: one process, the ranks of this machine, or one node's elastic agent."""

from __future__ import annotations

import argparse

from rich.console import Console

from shardforge.commands.arg_types import at_least
from shardforge.errors import ShardforgeError


def agent_mode(args: argparse.Namespace) -> bool:
    """`train --nnodes N` / `--rdzv-endpoint`: this process is one node's elastic agent, never a rank itself
    (whatever RANK, or SLURM's task variables, its launcher set: srun's one task per node, PyTorchJob)."""
    return getattr(args, "nnodes", 1) > 1 or getattr(args, "rdzv_endpoint", None) is not None


def _cmd_train(args: argparse.Namespace, console: Console) -> int:
    from shardforge.config import load_config
    from shardforge.launch import Rendezvous, already_a_rank, launch_local, parse_endpoint

    rendezvous = Rendezvous()
    if agent_mode(args):  # flags checked before the config, so a typo in them fails first and alone
        if args.rdzv_endpoint is None:
            raise ShardforgeError(f"--nnodes {args.nnodes} needs --rdzv-endpoint HOST:PORT (the first node)")
        if args.nnodes > 1 and not args.rdzv_id:
            raise ShardforgeError(f"--nnodes {args.nnodes} needs --rdzv-id ID, the same on every node")
        parse_endpoint(args.rdzv_endpoint)
        rendezvous = Rendezvous(args.nnodes, args.rdzv_endpoint, args.rdzv_id)
    config = load_config(args.config, args.overrides)  # a bad config fails here, before torch is imported
    if agent_mode(args) or (
        (args.nproc > 1 or args.max_restarts > 0) and not already_a_rank(translate=False)
    ):
        from shardforge.models.build import model_source
        from shardforge.planner.preflight import resolve_layout

        # Restarts need the elastic agent, even for a single process.
        # Layout errors surface here, once, before any process starts. Every node's agent must choose the
        # same `parallel: auto` layout: no measured (per-node) CPU peak in the search when there are several.
        world = rendezvous.nnodes * args.nproc
        shape = model_source(config.model)[0]
        resolved = resolve_layout(config, world, shape, measure=rendezvous.nnodes == 1)
        dims, estimate = resolved.dims, resolved.estimate
        overrides = list(args.overrides)
        if config.parallel.auto:  # the ranks run the layout chosen here (their own searches could differ)
            console.print(f"parallel: auto chose {estimate.layout.describe()} on {dims.world_size} ranks")
            overrides += ["parallel.auto=false", *estimate.layout.overrides()]
        argv = (["--debug"] if args.debug else []) + ["train", args.config, *overrides]
        return launch_local(args.nproc, args.max_restarts, argv, rendezvous)
    from shardforge.train.trainer import train

    result = train(config, console)
    eval_part = f", eval loss {result.eval_loss:.4f}" if result.eval_loss is not None else ""
    console.print(
        f"done: {result.steps} steps, final loss {result.final_loss:.4f}{eval_part}; "
        f"run folder {result.run_dir}"
    )
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    """`shardforge train`: the flags, and the handler as `func`."""
    p_train = sub.add_parser("train", help="run a training job from a YAML config")
    p_train.add_argument("config", help="path to the YAML config")
    p_train.add_argument(
        "overrides", nargs="*", help="dotted overrides, e.g. train.lr=3e-4 data.max_length=512"
    )
    p_train.add_argument(
        "--nproc", type=at_least(1), default=1, help="processes (ranks) to start on this machine"
    )
    p_train.add_argument(
        "--max-restarts", type=at_least(0), default=0, help="restart the job this often after a failure"
    )
    p_train.add_argument(
        "--nnodes",
        type=at_least(1),
        default=1,
        help="nodes of the job: run this node's elastic agent (--nproc ranks), meeting the others' at "
        "--rdzv-endpoint (what `shardforge launch` writes for each node)",
    )
    p_train.add_argument("--rdzv-endpoint", help="HOST:PORT of the first node, where the agents meet")
    p_train.add_argument("--rdzv-id", help="the job's rendezvous id, the same on every node")
    p_train.set_defaults(func=_cmd_train)
