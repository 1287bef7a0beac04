"""`method.pref.ref: precompute`: the starting policy's summed log-probs of every training and evaluation
sequence, computed once before training and stored beside the tokenized data (in the dataset cache entry,
under `reference/<identity>/`; in the run folder's `reference_logps/` without a cache), so that no reference
model is held during training and the reference follows any layout, pipelines included. Later runs and
resumed ones on the same data, model, method, seed and precision read them back.

Each rank scores every world-th pair on a whole copy of the starting model; the parts are gathered to every
rank (a collective: no shared filesystem needed) and rank 0 writes the result. Every rank attaches the array
to its example store, where the objective's collate picks each row's value up.
"""

from __future__ import annotations

import hashlib
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
    run_dir: Path,
    identity: dict[str, Any],
    micro_batch: int,
    pad_id: int,
    autocast: Callable[[], AbstractContextManager],
    say: Callable[[str], None],
) -> None:
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]
    training = model.training
    model.eval()
    for name, rows in rowsets.items():
        if rows is None:
            continue
        folder = rows.cached_at / "reference" / digest if rows.cached_at else run_dir / "reference_logps"
        key = {**identity, "examples": len(rows.examples), "tokens": int(rows.num_tokens)}
        path, meta = folder / f"{name}.npy", folder / f"{name}.json"
        stored = path.is_file() and meta.is_file() and json.loads(meta.read_text()) == key
        if not all(_gathered(stored)):  # every rank sees the stored values, or all compute them
            start = time.perf_counter()
            say(f"reference log-probs: computing {len(rows.examples)} {name} sequences ({world} rank(s))")
            mine = rows.rows_of(np.arange(rank, rows.num_groups, world))
            with autocast():
                values = objective.reference_logps(model, rows.examples, mine, micro_batch, pad_id)
            full = np.full(len(rows.examples), np.nan, dtype=np.float32)
            for index, logps in _gathered(([r[0] for r in mine], values)):
                full[np.asarray(index, dtype=np.int64)] = logps
            if rank == 0:
                folder.mkdir(parents=True, exist_ok=True)
                np.save(path, full)
                meta.write_text(json.dumps(key))
                took = time.perf_counter() - start
                say(f"reference log-probs: {name} done in {took:.1f} s, stored in {path}")
            rows.examples.ref_logps = full
        else:
            rows.examples.ref_logps = np.load(path)
    model.train(training)


def _gathered(part: Any) -> list[Any]:
    """Every rank's `part`, in rank order (a small picklable object)."""
    if not dist.is_initialized():
        return [part]
    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, part)
    return parts
