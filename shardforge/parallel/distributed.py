"""Process-group setup from the environment torchrun (or a SLURM translation) provides."""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from shardforge.errors import ConfigError


def world_size_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


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
    dist.init_process_group(backend=backend, timeout=datetime.timedelta(minutes=timeout_minutes))
    return True


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
