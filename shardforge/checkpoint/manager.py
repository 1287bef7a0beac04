"""CheckpointManager: which checkpoint a run continues from, and the saves along the way.

Rank 0 chooses the folder (the newest complete one, or the one `checkpoint.resume` names) and tells every
rank, so all load the same one even if their views of the filesystem differ for a moment, and an error
reaches every rank instead of leaving some waiting. Before anything is loaded, the checkpoint's signature
(what a continuation depends on: the model config as a whole, the padded vocabulary, the global batch, the
data, the seed, the optimizer-state format) is compared with this run's, and every difference is reported
at once.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardforge.checkpoint.compat import check_compatible
from shardforge.checkpoint.optim_state import FORMAT as OPTIMIZER_FORMAT
from shardforge.checkpoint.store import find_latest, resolve_checkpoint
from shardforge.checkpoint.trainer_state import Checkpointer, load_checkpoint, read_trainer_state
from shardforge.config.schema import CheckpointSection
from shardforge.errors import CheckpointError
from shardforge.log import get_logger

log = get_logger(__name__)


def signature(
    model_config: Any,
    vocab_rows: int,
    global_batch: int,
    rows: int | str,
    seed: int,
    finetuning: Any = None,
    critic_config: Any = None,
    optimizer: str = "adamw",
) -> dict:
    """What a continuation depends on. The model is its whole config (every field of the family's config
    dataclass except the original config.json it was read from, or the generic backend's transformers
    config), so a new field is compared without being listed here; so is PPO's separate critic model."""
    return {
        "model": _config_fields(model_config),
        "vocab_rows": vocab_rows,  # as the embedding holds it (padded for tensor parallel)
        "global_batch": global_batch,
        "rows": rows,
        "seed": seed,
        "finetuning": finetuning,  # None: full; else the method, its settings and the base it trains over
        "optimizer": optimizer,  # train.optimizer.name: whose states the checkpoint holds
        "optimizer_format": OPTIMIZER_FORMAT,
        "critic": None if critic_config is None else _config_fields(critic_config),
    }


def _config_fields(config: Any) -> dict:
    fields = dataclasses.fields(config)
    values = {f.name: getattr(config, f.name) for f in fields if f.name not in ("hf_config", "hf")}
    return json.loads(json.dumps(values, default=str))  # as the checkpoint's JSON holds it


class CheckpointManager:
    """Saves and restores everything a run holds besides its loop counters: model, optimizer, LR schedule and
    loss scale (`precision`: anything with state_dict/load_state_dict and a `mode`)."""

    def __init__(
        self,
        root: Path,
        section: CheckpointSection,
        signature: dict,
        parts: tuple[nn.Module, torch.optim.Optimizer, Any, Any],
        layout: tuple[int, str],
    ) -> None:
        self.root, self.section, self.signature = root, section, signature
        self.model, self.optimizer, self.scheduler, self.precision = parts
        self.world_size, self.layout = layout
        self.checkpointer = Checkpointer(root, section.keep, section.async_save)

    def _choose(self) -> Path | None:
        resume = self.section.resume
        if resume == "none":
            if find_latest(self.root, quiet=True) is not None:
                log.warning(
                    f"checkpoint.resume=none: starting fresh; the checkpoints in {self.root} will be "
                    f"replaced by this run's"
                )
            return None
        choice: list[tuple[str | None, str | None]] = [(None, None)]  # (folder, error): rank 0's answer
        if not dist.is_initialized() or dist.get_rank() == 0:
            try:
                found = find_latest(self.root) if resume == "auto" else resolve_checkpoint(Path(resume))
                choice = [(str(found) if found is not None else None, None)]
            except CheckpointError as exc:
                choice = [(None, f"checkpoint.resume={resume!r}: {exc}")]
        if dist.is_initialized():
            dist.broadcast_object_list(choice, src=0)
        folder, error = choice[0]
        if error is not None:  # every rank fails alike, none is left waiting
            raise CheckpointError(error)
        return Path(folder) if folder is not None else None

    def resume(self) -> dict | None:
        """Load the chosen checkpoint (resharded onto this layout): model, optimizer, schedule and, in fp16,
        the loss scale. Returns the loop's saved state, or None for a fresh start."""
        folder = self._choose()
        if folder is None:
            return None
        check_compatible(folder, read_trainer_state(folder), self.signature)
        state = load_checkpoint(folder, self.model, self.optimizer)
        self.scheduler.load_state_dict(state["scheduler"])
        if state["precision"]["mode"] == self.precision.mode:  # a loss scale means something in fp16 only
            self.precision.load_state_dict(state["precision"])
        log.info(
            f"resumed from {folder} (step {state['step']}, {state['samples_seen']} samples seen, saved by "
            f"{state['layout']})"
        )
        return state

    def save(self, step: int, loop_state: dict, extra_files: dict[str, str] | None, phase: Callable) -> Path:
        """A sharded checkpoint of `step` (collective); `loop_state` is the loop's own JSON-able state."""
        state = {
            "step": step,
            **loop_state,
            "scheduler": self.scheduler.state_dict(),
            "precision": self.precision.state_dict(),
            "world_size": self.world_size,
            "layout": self.layout,
            **self.signature,
        }
        return self.checkpointer.save(step, self.model, self.optimizer, state, extra_files, phase)

    @property
    def async_save(self) -> bool:
        return self.section.async_save

    def wait(self) -> None:
        """Finish and commit a save still in flight."""
        self.checkpointer.wait()
