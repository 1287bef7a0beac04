"""Checkpoint folders on disk: a checkpoint becomes visible only when complete, and an incomplete or damaged
one is recognised and skipped.

    <output_dir>/checkpoints/
        .tmp-step-00000040/    being written (every rank writes its shards here)
        step-00000030/         complete: DCP shards + .metadata, trainer.json, rng-rank*.pt, manifest.json
        latest                 the name of the newest complete checkpoint

Commit (rank 0, after every rank finished writing): list every file with its size in manifest.json, rename
the staging folder to its final name, then update `latest` (write + os.replace). A crash at any point leaves
either the previous checkpoints untouched or the new one complete. On resume a folder whose manifest is
missing, or whose files are missing or of another size (truncated), is skipped with a warning naming it.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from shardforge.errors import CheckpointError
from shardforge.log import get_logger

log = get_logger(__name__)

MANIFEST = "manifest.json"
TRAINER_STATE = "trainer.json"
DCP_METADATA = ".metadata"
LATEST = "latest"


def step_name(step: int) -> str:
    return f"step-{step:08d}"


def staging_dir(root: Path, step: int) -> Path:
    return root / f".tmp-{step_name(step)}"


def checkpoint_step(folder: Path) -> int | None:
    """The step of a `step-N` folder name, else None."""
    prefix, _, number = folder.name.partition("-")
    return int(number) if prefix == "step" and number.isdigit() else None


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def commit(staging: Path, step: int, keep: int | None) -> Path:
    """Make a fully written staging folder the checkpoint of `step` (rank 0 only), then prune old ones."""
    root = staging.parent
    files = {
        p.relative_to(staging).as_posix(): p.stat().st_size for p in sorted(staging.rglob("*")) if p.is_file()
    }
    _write_atomic(staging / MANIFEST, json.dumps({"step": step, "files": files}, indent=1))
    final = root / step_name(step)
    if final.exists():  # the same step saved again after a restart: replace it
        shutil.rmtree(final)
    os.rename(staging, final)
    _write_atomic(root / LATEST, final.name + "\n")
    prune(root, keep, step)
    return final


def prune(root: Path, keep: int | None, step: int) -> None:
    """After committing `step`: keep it and the newest `keep - 1` before it (None: all). Checkpoints of
    later steps belong to a run this one replaced (it resumed from an earlier step, or started fresh) and
    are dropped, as are staging folders left by crashes."""
    complete = sorted((d for d in root.glob("step-*") if checkpoint_step(d) is not None), key=checkpoint_step)
    later = [d for d in complete if checkpoint_step(d) > step]
    earlier = [d for d in complete if checkpoint_step(d) <= step]
    for old in later + (earlier[:-keep] if keep is not None else []):
        shutil.rmtree(old, ignore_errors=True)
    for stale in root.glob(".tmp-step-*"):
        shutil.rmtree(stale, ignore_errors=True)


def validate(folder: Path) -> str | None:
    """None if `folder` is a complete checkpoint, else what is wrong with it."""
    if not folder.is_dir():
        return "not a folder"
    manifest = folder / MANIFEST
    if not manifest.is_file():
        return f"no {MANIFEST} (the save did not finish)"
    try:
        files = json.loads(manifest.read_text())["files"]
    except (json.JSONDecodeError, KeyError, TypeError):
        return f"{MANIFEST} is unreadable"
    for required in (DCP_METADATA, TRAINER_STATE):
        if required not in files:
            return f"{required} is not listed in {MANIFEST}"
    for name, size in files.items():
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != size:
            return f"{name} has {path.stat().st_size} bytes, {size} were written (truncated or altered)"
    return None


def find_latest(root: Path, *, quiet: bool = False) -> Path | None:
    """The newest complete checkpoint under `root`; damaged ones are skipped (logged, unless `quiet`)."""
    if not root.is_dir():
        return None
    candidates = sorted(
        (d for d in root.glob("step-*") if checkpoint_step(d) is not None), key=checkpoint_step, reverse=True
    )
    for folder in candidates:
        problem = validate(folder)
        if problem is None:
            return folder
        if not quiet:
            log.warning(f"skipping checkpoint {folder}: {problem}; trying an older one")
    return None


def resolve_checkpoint(path: Path) -> Path:
    """`path` itself if it is a complete checkpoint; for a run folder, its newest complete checkpoint."""
    if (path / "checkpoints").is_dir():
        found = find_latest(path / "checkpoints")
        if found is None:
            raise CheckpointError(f"{path} is a run folder without a complete checkpoint")
        return found
    problem = validate(path)
    if problem is not None:
        raise CheckpointError(f"{path} is not a usable checkpoint: {problem}")
    return path
