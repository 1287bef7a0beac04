"""Run a function on N gloo ranks (spawned processes on this machine) and collect what each returns."""

from __future__ import annotations

import datetime
import faulthandler
import os
import socket
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(fn: Callable, rank: int, world: int, port: int, out: str, args: tuple) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
    )
    torch.set_num_threads(1)
    fault = (Path(out) / f"rank{rank}.fault").open(
        "w"
    )  # a native crash's stacks (a segfault leaves no traceback)
    faulthandler.enable(fault, all_threads=True)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
        result = fn(*args)
        torch.save(result, Path(out) / f"rank{rank}.pt")
    except BaseException:
        (Path(out) / f"rank{rank}.err").write_text(traceback.format_exc())
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        faulthandler.disable()
        fault.close()


def run_ranks(fn: Callable, world: int, *args: Any, timeout: float = 600) -> list[Any]:
    """fn(*args) on every rank (a module-level function); returns the per-rank results in rank order."""
    ctx = mp.get_context("spawn")
    port = _free_port()
    with tempfile.TemporaryDirectory() as out:
        procs = [ctx.Process(target=_entry, args=(fn, r, world, port, out, args)) for r in range(world)]
        for p in procs:
            p.start()
        deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout)
        for p in procs:
            p.join(max(1.0, (deadline - datetime.datetime.now()).total_seconds()))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
        errors = {
            r: (Path(out) / f"rank{r}.err").read_text()
            for r in range(world)
            if (Path(out) / f"rank{r}.err").exists()
        }
        # a rank that left no traceback died outside Python: its exit code says how (-9: killed, e.g. OOM)
        silent = {
            r: p.exitcode for r, p in enumerate(procs) if r not in errors and p.exitcode not in (0, None)
        }
        for r in silent:
            fault = Path(out) / f"rank{r}.fault"
            stacks = fault.read_text() if fault.exists() else "(none: it died before it started)"
            errors[r] = f"exit code {silent[r]}; native stacks:\n{stacks}"
        if errors or hung or silent:
            detail = "\n".join(f"--- rank {r}:\n{e}" for r, e in errors.items())
            raise AssertionError(
                f"ranks failed (hung: {hung}, died without a traceback: {silent}):\n{detail}"
            )
        return [torch.load(Path(out) / f"rank{r}.pt", weights_only=False) for r in range(world)]
