"""Starting ranks: `--nproc N` launches N local processes through torch's elastic launcher (torchrun's
engine); under torchrun or SLURM the same command joins as one rank.
Application layer: reads the environment."""

from __future__ import annotations

import os
import sys
import uuid

from shardforge.errors import ShardforgeError


def already_a_rank(translate: bool = True) -> bool:
    """True under torchrun (or anything that set RANK/WORLD_SIZE); a SLURM task is translated first."""
    if translate and "RANK" not in os.environ and int(os.environ.get("SLURM_NTASKS", "1")) > 1:
        _translate_slurm()
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _translate_slurm() -> None:
    """srun starts one task per rank: map SLURM's variables onto the ones torch.distributed reads."""
    env = os.environ
    master = env.get("MASTER_ADDR") or env.get("SLURM_LAUNCH_NODE_IPADDR")
    if master is None:
        raise ShardforgeError(
            "running under SLURM with several tasks: set MASTER_ADDR to the first node's address"
        )
    env.update(
        RANK=env["SLURM_PROCID"],
        WORLD_SIZE=env["SLURM_NTASKS"],
        LOCAL_RANK=env.get("SLURM_LOCALID", "0"),
        MASTER_ADDR=master,
        MASTER_PORT=env.get("MASTER_PORT", "29500"),
    )


def launch_local(nproc: int, max_restarts: int, argv: list[str]) -> int:
    """Run `python -m shardforge ARGV` as `nproc` ranks on this machine; returns the job's exit code."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    # As torchrun does for several local ranks: one intra-op thread each unless the user says otherwise
    # (hardware.threads still applies inside each rank).
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"shardforge-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",  # a free port, as `torchrun --standalone`
        max_restarts=max_restarts,
        monitor_interval=0.5,
    )
    try:
        elastic_launch(config, sys.executable)("-m", "shardforge", *argv)
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        print(
            f"error: rank {rank} failed with exit code {failure.exitcode}; its message is above",
            file=sys.stderr,
        )
        return failure.exitcode if failure.exitcode > 0 else 1
    return 0
