"""Process-level facts the loop needs: device, threads, seeds, memory in use (the peak FLOP/s: peak.py)."""

from __future__ import annotations

import os
import random

import numpy as np
import torch

from shardforge.errors import ConfigError


def pick_device(choice: str, local_rank: int = 0) -> torch.device:
    """CUDA (this process's GPU by local rank) when available or asked for, else the CPU."""
    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ConfigError("hardware.device=cuda but no CUDA device is available (use auto or cpu)")
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def memory_bytes(device: torch.device) -> dict[str, int]:
    """Resident memory of this process, plus peak allocated accelerator memory when there is one."""
    out = {}
    try:
        with open("/proc/self/statm") as f:
            out["rss_bytes"] = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        pass
    if device.type == "cuda":
        out["cuda_max_allocated_bytes"] = torch.cuda.max_memory_allocated(device)
    return out
