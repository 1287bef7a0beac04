"""`method.pref.ref: precompute`: the starting policy's summed log-probs of every training and evaluation
sequence, computed once before training and kept beside the run (`reference_logps/` in the run folder, reused
when a run resumes or restarts on the same model and data), so that no reference model is held during
training and the reference follows any layout, pipelines included.

Each rank computes every world-th pair on a whole copy of the starting model, writes its part, and rank 0
joins the parts; every rank then attaches the array to its example store, where the objective's collate picks
each row's value up.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import numpy as np
import torch.distributed as dist
from torch import nn

from shardforge.data.loader import RowSet


def precompute_reference(
    objective: Any,
    model: nn.Module,
    rowsets: dict[str, RowSet | None],
    folder: Path,
    identity: dict[str, Any],
    micro_batch: int,
    pad_id: int,
    autocast: Callable[[], AbstractContextManager],
    say: Callable[[str], None],
) -> None:
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    folder.mkdir(parents=True, exist_ok=True)
    training = model.training
    model.eval()
    for name, rows in rowsets.items():
        if rows is None:
            continue
        key = {**identity, "examples": len(rows.examples), "tokens": int(rows.num_tokens)}
        path, meta = folder / f"{name}.npy", folder / f"{name}.json"
        if not (path.is_file() and meta.is_file() and json.loads(meta.read_text()) == key):
            start = time.perf_counter()
            say(f"reference log-probs: computing {len(rows.examples)} {name} sequences ({world} rank(s))")
            mine = rows.rows_of(np.arange(rank, rows.num_groups, world))
            with autocast():
                values = objective.reference_logps(model, rows.examples, mine, micro_batch, pad_id)
            np.save(
                folder / f"{name}.part{rank}.npy", np.stack([[r[0] for r in mine], values]).astype(np.float64)
            )
            _barrier()
            if rank == 0:
                full = np.full(len(rows.examples), np.nan, dtype=np.float32)
                for r in range(world):
                    part = folder / f"{name}.part{r}.npy"
                    index, logps = np.load(part)
                    full[index.astype(np.int64)] = logps
                    part.unlink()
                np.save(path, full)
                meta.write_text(json.dumps(key))
                took = time.perf_counter() - start
                say(f"reference log-probs: {name} done in {took:.1f} s, saved to {path}")
        _barrier()
        rows.examples.ref_logps = np.load(path)
    model.train(training)


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()
