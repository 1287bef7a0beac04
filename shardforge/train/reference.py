"""Binding an objective to its run (`bind_objective`: the objective's `bind`, then a precomputed reference).

`method.pref.ref: precompute`: the starting policy's summed log-probs of every training and evaluation
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
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from shardforge.adapters.apply import apply_finetuning
from shardforge.config.schema import Config
from shardforge.data.loader import RowSet
from shardforge.errors import ConfigError
from shardforge.log import get_logger
from shardforge.models.build import build_model
from shardforge.objectives.base import BindContext, Objective
from shardforge.objectives.preference import ReferencedObjective
from shardforge.parallel.dims import ParallelDims
from shardforge.parallel.engine import dp_sum
from shardforge.parallel.parallelize import lay_out_frozen
from shardforge.train.precision import Precision

log = get_logger(__name__)


def bind_objective(
    cfg: Config,
    objective: Objective,
    model: nn.Module,
    *,
    tokenizer: Any,
    dims: ParallelDims,
    mesh: DeviceMesh | None,
    device: torch.device,
    precision: Precision,
    rows: dict[str, RowSet | None],
    run_dir: Path,
) -> None:
    """The objective takes what it needs from the run before any layout (`Objective.bind`: a reference
    model laid out as the policy will be, a reduction over the data-parallel ranks); a precomputed
    reference is then computed from the starting policy, or read back."""
    lay_out = partial(lay_out_frozen, dims=dims, mesh=mesh, config=cfg, device=device)
    reduce = partial(dp_sum, dims=dims, mesh=mesh)
    said = objective.bind(BindContext(model, cfg.model.adapter, cfg.model.path, dims.pp > 1, reduce, lay_out))
    if said is not None:
        log.info(said)
    if objective.traits.reference != "precomputed":
        return
    if rows["train"] is None:
        raise ConfigError("method.pref.ref=precompute needs the training data cached, not data.streaming")
    if dims.pp > 1:  # a pipeline rank holds only its stages: a whole copy for this pass, dropped after it
        model = build_model(cfg.model, tokenizer, cfg.train.seed, device)
        apply_finetuning(model, cfg.method, cfg.train.seed, cfg.model.adapter)
    # What the starting policy's log-probs depend on (fresh LoRA adapters change nothing: B starts at 0).
    identity = {"model": cfg.model.model_dump(), "seed": cfg.train.seed, "precision": cfg.train.precision}
    precompute_reference(
        objective, model, rows, run_dir, json.loads(json.dumps(identity)),
        cfg.train.micro_batch, tokenizer.pad_token_id, precision.autocast,
    )  # fmt: skip


def precompute_reference(
    objective: ReferencedObjective,
    model: nn.Module,
    rowsets: dict[str, RowSet | None],
    run_dir: Path,
    identity: dict[str, Any],
    micro_batch: int,
    pad_id: int,
    autocast: Callable[[], AbstractContextManager],
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
            log.info(
                f"reference log-probs: computing {len(rows.examples)} {name} sequences ({world} rank(s))"
            )
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
                log.info(f"reference log-probs: {name} done in {took:.1f} s, stored in {path}")
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
