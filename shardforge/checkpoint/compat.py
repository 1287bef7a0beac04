"""Can this run continue from that checkpoint? The checkpoint records what the continuation depends on; a
mismatch is a clear error naming each difference and what to change, never a raw shape error from deep in
torch.distributed.checkpoint or a silently different run."""

from __future__ import annotations

from pathlib import Path

from shardforge.errors import CheckpointError

_ADVICE = {
    "model": "resume with the model the checkpoint was trained from",
    "vocab_rows": (
        "the vocabulary is padded for the tensor-parallel degree: resume with a tp that pads alike, or "
        "export the checkpoint (shardforge export) and start a new run from the exported model"
    ),
    "global_batch": (
        "steps and the schedule count global batches: set train.global_batch to the saved value (grad_accum "
        "then follows from micro_batch and the data-parallel size)"
    ),
    "rows": "the training data changed (a different number of rows): the saved data position does not apply",
    "seed": "the data order follows train.seed: resume with the saved seed",
    "finetuning": (
        "the checkpoint holds what its method trains (adapters, or some layers) over its base model: resume "
        "with the same method.finetuning and settings over the same model.path"
    ),
    "critic": (
        "the checkpoint holds PPO's separate critic model (method.ppo.critic) of that shape, or none: resume "
        "with the critic it was trained with"
    ),
    "optimizer": (
        "the checkpoint holds that optimizer's states: resume with train.optimizer.name as saved, or export "
        "the weights (shardforge export) and start a new run with the other optimizer from them"
    ),
    "optimizer_format": (
        "the optimizer states are stored in another layout (an older shardforge): resume with the version "
        "that wrote it, or export the weights (shardforge export) and start a new run from them"
    ),
}


def check_compatible(folder: Path, saved: dict, current: dict) -> None:
    """`saved` and `current` map the keys of _ADVICE to values; every difference is reported at once (for the
    model, field by field)."""
    problems = []
    for key in _ADVICE:
        # a checkpoint from before train.optimizer holds AdamW's states
        was, now = saved.get(key, "adamw" if key == "optimizer" else None), current[key]
        if was == now:
            continue
        if key in ("model", "critic") and isinstance(was, dict) and isinstance(now, dict):
            fields = sorted(k for k in was.keys() | now.keys() if was.get(k) != now.get(k))
            shown = ", ".join(f"{k} {was.get(k)!r} -> {now.get(k)!r}" for k in fields)
            problems.append(f"{key}: {shown} (checkpoint -> this run; {_ADVICE[key]})")
        elif key == "model" and not isinstance(was, dict):
            problems.append(
                f"model: the checkpoint records its model in an older form ({_ADVICE['optimizer_format']})"
            )
        else:
            problems.append(f"{key}: checkpoint {was!r}, this run {now!r} ({_ADVICE[key]})")
    if problems:
        raise CheckpointError(f"{folder} cannot be resumed by this run: " + "; ".join(problems))
