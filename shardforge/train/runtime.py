"""Process-level facts the loop needs: device, threads, seeds, measured matmul peak, memory in use."""

from __future__ import annotations

import os
import random
import time

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


def measure_matmul_peak(
    device: torch.device, dtype: torch.dtype = torch.float32, seconds: float = 0.3
) -> float:
    """FLOP/s of a square matmul on this device: the MFU denominator when hardware.peak_flops is unset."""
    # CPUs without bf16/fp16 units run low precision ~100x slower: a smaller matrix keeps this under a second.
    n = 8192 if device.type == "cuda" else (1024 if dtype == torch.float32 else 256)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    a @ b  # warm-up
    best, deadline = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        start = time.perf_counter()
        a @ b
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = max(best, 2 * n**3 / (time.perf_counter() - start))
    return best


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
