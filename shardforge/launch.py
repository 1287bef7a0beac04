"""Starting ranks: `--nproc N` launches N local processes through torch's elastic launcher (torchrun's
engine); with `--nnodes N --rdzv-endpoint HOST:PORT` the same agent runs on each of N nodes and the agents
meet in torch's c10d rendezvous (what `shardforge launch` writes for SLURM and Kubernetes); under torchrun or
SLURM's one task per rank the command joins as one rank.
Application layer: reads the environment."""

from __future__ import annotations

import dataclasses
import math
import os
import signal
import sys
import uuid
from dataclasses import dataclass

from shardforge.errors import ShardforgeError
from shardforge.log import get_logger


@dataclass(frozen=True)
class Rendezvous:
    """Where the nodes' agents meet: every node's agent names the same endpoint (the first node's HOST:PORT,
    whose agent hosts the store) and run id. The default is one node: this machine, on a free port."""

    nnodes: int = 1
    endpoint: str = "localhost:0"  # a free port, as `torchrun --standalone`
    run_id: str | None = None  # None: a fresh one (only right for one node: every node must share it)


def parse_endpoint(text: str, flag: str = "--rdzv-endpoint") -> tuple[str, int]:
    """`HOST:PORT` -> (host, port), else an error naming the flag and the value."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ShardforgeError(f"{flag} {text!r}: expected HOST:PORT, a port in 1..65535 (e.g. node1:29500)")
    return host, int(port)


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


def _shutdown_grace(launch_config: type, stop_grace: float | None) -> dict:
    """How long torch's agent waits for the ranks after passing a SIGTERM on: the server's graceful shutdown
    and 30 s more. A torch without `LaunchConfig.shutdown_timeout` (before 2.12) waits its fixed 30 s: said
    once, since a longer drain is cut there."""
    if stop_grace is None:
        return {}
    if "shutdown_timeout" not in {f.name for f in dataclasses.fields(launch_config)}:
        get_logger(__name__).warning(
            "this torch's launcher has no shutdown_timeout (torch 2.12+): on SIGTERM the ranks get its "
            f"fixed 30 s, not the {math.ceil(stop_grace) + 30} s a graceful shutdown may take"
        )
        return {}
    return {"shutdown_timeout": math.ceil(stop_grace) + 30}


def launch_local(
    nproc: int,
    max_restarts: int,
    argv: list[str],
    rendezvous: Rendezvous | None = None,
    stop_grace: float | None = None,
) -> int:
    """Run `python -m shardforge ARGV` as `nproc` ranks on this machine (this node's share of a multi-node
    job when `rendezvous` names other nodes); returns the job's exit code. A restart restarts every node's
    ranks (the other agents see the failed node rejoin the rendezvous). SIGTERM or SIGINT reach every rank
    (torch's agent passes them on and waits for the ranks); `stop_grace`: that is how the job ends (a
    server's graceful shutdown, which takes up to that many seconds, and 30 more are allowed before the
    ranks are killed: exit 0), else (None) the job was interrupted (128 + the signal)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    rendezvous = rendezvous or Rendezvous()
    if rendezvous.nnodes > 1 and rendezvous.run_id is None:
        raise ShardforgeError(f"--nnodes {rendezvous.nnodes}: every node's agent needs the same --rdzv-id")
    # As torchrun does for several local ranks: one intra-op thread each unless the user says otherwise
    # (hardware.threads still applies inside each rank).
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if rendezvous.nnodes > 1:
        # The ranks of each rendezvous round get a store of their own (on rank 0, its address under the
        # round's keys) instead of the agents' shared one. In the shared store, parallel/distributed.py tells
        # restart attempts apart by TORCHELASTIC_RESTART_COUNT, which is per agent: an agent restarted by
        # another node's failure does not count it, so after a restart ranks could read a dead rank's address.
        os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    config = LaunchConfig(
        **_shutdown_grace(LaunchConfig, stop_grace),
        min_nodes=rendezvous.nnodes,
        max_nodes=rendezvous.nnodes,
        nproc_per_node=nproc,
        run_id=rendezvous.run_id or f"shardforge-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint=rendezvous.endpoint,
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
    except SignalException as exc:
        name = signal.Signals(exc.sigval).name
        print(f"{name}: passed on to the {nproc} ranks, which have stopped", file=sys.stderr)
        graceful = stop_grace is not None and exc.sigval in (signal.SIGTERM, signal.SIGINT)
        return 0 if graceful else 128 + int(exc.sigval)
    return 0
