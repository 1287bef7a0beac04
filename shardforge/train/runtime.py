"""Process-level facts the loop needs: the process group, the run folder and mesh, seeds, the peak MFU is
measured against, and memory in use (the device: parallel/distributed.py)."""

from __future__ import annotations

import datetime
import math
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from rich.console import Console
from torch.distributed.device_mesh import DeviceMesh

from shardforge.config import Config, dump_config
from shardforge.errors import ConfigError
from shardforge.parallel.dims import ParallelDims
from shardforge.parallel.distributed import init_distributed, pick_backend
from shardforge.planner.peak import model_gemm_shapes, peak_flops


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


def console_for(quiet: bool = False) -> Console:
    """Library output never hard-wraps: a path or a checkpoint name in a log file (SLURM, CI, pytest)
    must stay on one line whatever the width of a terminal that is not there."""
    return Console(soft_wrap=True, quiet=quiet)


@dataclass(frozen=True)
class Workspace:
    """Where a run's processes stand: its folder, the device mesh, whether this is rank 0 (which logs and
    writes), its console (quiet elsewhere), and whether this run created the process group."""

    run_dir: Path
    device: torch.device
    mesh: DeviceMesh | None
    is_main: bool
    console: Console
    owns_process_group: bool


def start_processes(cfg: Config, device: torch.device) -> bool:
    """Join the job's process group, when there are several ranks (True: this call created it)."""
    return init_distributed(pick_backend(cfg.parallel.backend, device), cfg.parallel.timeout_minutes)


def build_workspace(
    cfg: Config, dims: ParallelDims, device: torch.device, console: Console, owns: bool
) -> Workspace:
    """The run folder (the resolved config written into it by rank 0), the mesh, threads and seeds."""
    if cfg.hardware.threads:
        torch.set_num_threads(cfg.hardware.threads)
    run_dir = Path(cfg.output_dir)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"output_dir {str(run_dir)!r} cannot be created: {exc.strerror}") from None
    mesh = dims.build_mesh(device.type, datetime.timedelta(minutes=cfg.parallel.timeout_minutes))
    is_main = not dist.is_initialized() or dist.get_rank() == 0
    seed_everything(cfg.train.seed)
    if is_main:
        dump_config(cfg, run_dir / "config.yaml")
    return Workspace(run_dir, device, mesh, is_main, console if is_main else console_for(quiet=True), owns)


def build_peak(cfg: Config, model_config: Any, dims: ParallelDims, device: torch.device, dtype: torch.dtype,
               is_main: bool) -> tuple[float, str]:  # fmt: skip
    """The MFU denominator. Only rank 0 logs MFU, so only it probes: the other ranks wait at their first
    collective meanwhile instead of competing for the cores the probe measures."""
    if not is_main:
        return cfg.hardware.peak_flops or math.nan, "rank 0 measures the peak"
    shapes = model_gemm_shapes(model_config, cfg.train.micro_batch * cfg.data.max_length, dims.tp)
    return peak_flops(device, dtype, cfg.hardware.peak_flops, shapes)
