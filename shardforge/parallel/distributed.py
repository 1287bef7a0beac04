"""Process-group setup from the environment torchrun (or a SLURM translation) provides."""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from shardforge.errors import ConfigError


def world_size_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def rank_from_env() -> int:
    """This process's global rank as its launcher set it (0 when it is the only one)."""
    return int(os.environ.get("RANK", "0"))


def local_rank_from_env() -> int:
    """This process's index on its node (which GPU it drives)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def pick_backend(choice: str, device: torch.device) -> str:
    if choice == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    if choice == "nccl" and (device.type != "cuda" or not dist.is_nccl_available()):
        raise ConfigError(
            "parallel.backend=nccl needs CUDA devices and an NCCL build of torch; use gloo or auto"
        )
    if not dist.is_backend_available(choice):
        raise ConfigError(f"parallel.backend={choice} is not available in this torch build (try auto)")
    return choice


def init_distributed(backend: str, timeout_minutes: float) -> bool:
    """Join the process group described by RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT (set by torchrun).

    Returns True if this call created the group (and so its caller should destroy it)."""
    if dist.is_initialized() or world_size_from_env() == 1:
        return False
    timeout = datetime.timedelta(minutes=timeout_minutes)
    store = _restart_safe_store(timeout)
    if store is None:
        dist.init_process_group(backend=backend, timeout=timeout)
    else:
        rank, world = int(os.environ["RANK"]), world_size_from_env()
        dist.init_process_group(backend=backend, timeout=timeout, store=store, rank=rank, world_size=world)
    return True


def _restart_safe_store(timeout: datetime.timedelta) -> dist.Store | None:
    """Under torch elastic's agent store, a key namespace per restart attempt.

    The agent keeps one TCPStore for all attempts of a job, and process groups register their peers'
    addresses under fixed keys: after a restart, a rank could read a dead peer's address written by the
    previous attempt before the new peer overwrites it, and fail with "Connection refused" (seen with gloo
    under --max-restarts). Prefixing with the attempt number gives every attempt fresh keys."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    client = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world_size_from_env(),
        is_master=False,
        timeout=timeout,
    )
    return dist.PrefixStore(f"shardforge/attempt_{attempt}", client)


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def pick_device(choice: str, local_rank: int = 0) -> torch.device:
    """CUDA (this process's GPU by local rank) when available or asked for, else the CPU."""
    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ConfigError("hardware.device=cuda but no CUDA device is available (use auto or cpu)")
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
