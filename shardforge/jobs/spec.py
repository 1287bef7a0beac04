"""What a multi-node job runs, whichever scheduler starts it: one `shardforge train` agent per node, the
agents meeting in torch's c10d rendezvous on the first node, each starting its node's ranks, restarting every
node's ranks after a failure (`--max-restarts`) and resuming from the run's newest complete checkpoint
(`checkpoint.resume: auto`). The renderers (slurm.py, k8s.py) only say how their scheduler starts it and how
the first node is named there."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from shardforge.config import Config
from shardforge.errors import ShardforgeError

RDZV_PORT = 29500  # torchrun's default port


@dataclass(frozen=True)
class JobSpec:
    """One job: `nodes` x `procs_per_node` ranks of `shardforge train CONFIG OVERRIDES`."""

    name: str  # the scheduler's job name (SLURM job, Kubernetes objects)
    config_path: str  # the config file as the nodes read it (a renderer may ship it elsewhere)
    overrides: tuple[str, ...]  # dotted overrides, the hardware section's included
    nodes: int
    procs_per_node: int  # devices (GPUs) per node, one rank each
    max_restarts: int
    output_dir: str  # the config's, where checkpoints are (resume reads them)
    gpus: bool = True  # request GPUs from the scheduler (not for hardware.device=cpu)
    rdzv_port: int = RDZV_PORT

    @property
    def world(self) -> int:
        return self.nodes * self.procs_per_node

    def train_args(self, config_path: str | None = None, extra: tuple[str, ...] = ()) -> list[str]:
        """A node's `shardforge train` arguments, less `--rdzv-endpoint` and `--rdzv-id` (each scheduler names
        the first node and the job its own way). `extra` overrides come last, so they win."""
        return [
            "train",
            config_path or self.config_path,
            *self.overrides,
            *extra,
            "--nproc",
            str(self.procs_per_node),
            "--nnodes",
            str(self.nodes),
            "--max-restarts",
            str(self.max_restarts),
        ]


def default_name(config_path: str | Path) -> str:
    """`shardforge-<config stem>`, lowercased to what every scheduler accepts (a DNS label: Kubernetes)."""
    stem = re.sub(r"[^a-z0-9-]+", "-", Path(config_path).stem.lower()).strip("-") or "job"
    return f"shardforge-{stem}"[:40].rstrip("-")


def job_spec(
    config: Config,
    config_path: str | Path,
    overrides: list[str] | tuple[str, ...] = (),
    *,
    name: str | None = None,
    nodes: int | None = None,
    procs_per_node: int | None = None,
    max_restarts: int = 0,
    rdzv_port: int = RDZV_PORT,
) -> JobSpec:
    """The job for an already loaded (so valid) config: nodes and processes per node default to its hardware
    section; they go into the job's overrides too, so the planner and preflight see the cluster it runs on."""
    nodes = config.hardware.nodes if nodes is None else nodes
    per_node = config.hardware.devices_per_node if procs_per_node is None else procs_per_node
    if per_node is None:
        raise ShardforgeError(
            "--gpus-per-node is not given and the config sets no hardware.devices_per_node: say how many "
            "processes (one per GPU) each node starts"
        )
    counts = (("--nodes", nodes, 1), ("--gpus-per-node", per_node, 1), ("--max-restarts", max_restarts, 0))
    for flag, value, low in counts:
        if value < low:
            raise ShardforgeError(f"{flag} {value}: must be at least {low}")
    if not 0 < rdzv_port < 65536:
        raise ShardforgeError(f"--rdzv-port {rdzv_port}: must be in 1..65535")
    hardware = (f"hardware.nodes={nodes}", f"hardware.devices_per_node={per_node}")
    return JobSpec(
        name=name or default_name(config_path),
        config_path=str(Path(config_path).resolve()),
        overrides=(*overrides, *hardware),
        nodes=nodes,
        procs_per_node=per_node,
        max_restarts=max_restarts,
        output_dir=config.output_dir,
        gpus=config.hardware.device != "cpu",
        rdzv_port=rdzv_port,
    )


def restart_warnings(config: Config, max_restarts: int) -> list[str]:
    """What would make a restarted job start over instead of resuming where it failed."""
    if max_restarts == 0:
        return []
    out = []
    if config.checkpoint.every is None:
        out.append(
            f"checkpoint.every is unset: a restart (--max-restarts {max_restarts}) starts the run over from "
            "step 0; set checkpoint.every=N to resume from the newest checkpoint"
        )
    resume = config.checkpoint.resume
    if resume == "none":
        out.append("checkpoint.resume=none: every restart starts over; checkpoint.resume=auto resumes")
    elif resume != "auto":
        out.append(
            f"checkpoint.resume={resume!r}: every restart resumes from that checkpoint again, not from this "
            "run's newest one (checkpoint.resume=auto does)"
        )
    return out
