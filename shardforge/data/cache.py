"""The dataset cache: a data set is tokenized once, into flat arrays (data/store.py) in a folder keyed by
everything the encoding depends on; every later run, and every rank of a job, memory-maps it.

    <cache root>/<key>/
        train/ eval/          tokens.npy, flags.npy, offsets.npy, num_targets.npy, stats.json
        manifest.json         written last: format, key, every file's size

The key hashes the data section (less what only lays rows out), the data files' paths, sizes and mtimes, the
tokenizer's files and chat template, the objective and its settings, the seed (it picks held-out records)
and the source of the encoding code itself, so an edit to a template or a reader never meets a stale cache.
One process per node (local rank 0) builds a missing cache into a staging folder and renames it into place;
the other ranks wait for the manifest (with a progress line and a generous timeout of their own, not the
collective timeout), then load. A folder whose manifest is missing or whose files have other sizes is never
used: the builder replaces it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from shardforge.data.examples import EncodeStats
from shardforge.data.store import ExampleStore
from shardforge.errors import DataError
from shardforge.log import get_logger

log = get_logger(__name__)
FORMAT = 1
MANIFEST = "manifest.json"
SPLITS = ("train", "eval")
WAIT_S = 2 * 3600.0  # how long a rank waits for another to build the cache before giving up
_CODE = (
    "data/formats.py",
    "data/files.py",
    "data/tools.py",
    "data/values.py",
    "data/dataset_info.py",
    "data/templates.py",
    "data/examples.py",
    "data/encode.py",
    "data/store.py",
    "data/media.py",
    "data/images.py",
    # what an image's mark becomes (its tokens, counted by the family): written into every cached sequence
    "models/common/images.py",
    "models/qwen2_vl/model.py",
    "models/llava/model.py",
    "models/llava/next.py",
)

Splits = dict[str, tuple[ExampleStore, EncodeStats] | None]


def default_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "shardforge" / "datasets"


def file_fingerprint(paths: list[Path]) -> list[tuple[str, int, int]]:
    """(resolved path, size, mtime in ns) of each file: a changed file gets a new key without being read."""
    out = []
    for path in sorted({p.resolve() for p in paths}):
        stat = path.stat()
        out.append((str(path), stat.st_size, stat.st_mtime_ns))
    return out


def code_fingerprint(extra_files: list[Path]) -> str:
    """A hash of the encoding code (readers, templates, examples, the objectives' encoders)."""
    package = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for path in [package / name for name in _CODE] + sorted(extra_files):
        digest.update(path.read_bytes())
    return digest.hexdigest()


def cache_key(identity: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:32]


@dataclass(frozen=True)
class DatasetCache:
    """Where the cache lives and who builds it: `builder` is local rank 0."""

    root: Path
    builder: bool
    wait_s: float = WAIT_S

    def load_or_build(self, identity: dict[str, Any], build: Callable[[], Splits]) -> tuple[Splits, bool]:
        """The cached splits for `identity`, building them with `build` if this process is the builder and
        the cache has none (or a damaged one). Returns (splits, whether this process built them)."""
        folder = self.root / cache_key(identity)
        problem = _check(folder)
        if problem is None:
            return _load(folder), False
        if not self.builder:
            return self._wait(folder), False
        if folder.exists():
            log.info(f"dataset cache {folder} is not usable ({problem}): rebuilding it")
        log.info(f"tokenizing into the dataset cache {folder} (once: later runs and other ranks map it)")
        splits = build()
        try:
            _write(folder, identity, splits)
        except OSError as exc:
            raise DataError(
                f"data.cache_dir {str(self.root)!r}: cannot write the dataset cache ({exc.strerror or exc}); "
                f"set data.cache_dir to a writable folder, or data.cache=false"
            ) from None
        return _load(folder), True

    def _wait(self, folder: Path) -> Splits:
        start = last = time.monotonic()
        while (problem := _check(folder)) is not None:
            now = time.monotonic()
            if now - start > self.wait_s:
                raise DataError(
                    f"waited {self.wait_s / 60:.0f} min for local rank 0 to build the dataset cache {folder} "
                    f"({problem}); build it ahead with `shardforge data prepare CONFIG`"
                )
            if now - last > 30:
                log.info(f"waiting for local rank 0 to tokenize into {folder} ({now - start:.0f} s)")
                last = now
            time.sleep(0.5)
        return _load(folder)


def _check(folder: Path) -> str | None:
    """None if `folder` is a complete cache of this format, else what is wrong."""
    manifest = folder / MANIFEST
    if not manifest.is_file():
        return "no manifest"
    try:
        meta = json.loads(manifest.read_text())
        files = meta["files"]
    except (ValueError, KeyError, TypeError):
        return "unreadable manifest"
    if meta.get("format") != FORMAT:
        return f"format {meta.get('format')}, expected {FORMAT}"
    for name, size in files.items():
        path = folder / name
        if not path.is_file() or path.stat().st_size != size:
            return f"{name} is missing or has another size (truncated or altered)"
    return None


def _load(folder: Path) -> Splits:
    out: Splits = {}
    for split in SPLITS:
        part = folder / split
        if not part.is_dir():
            out[split] = None
            continue
        stats = EncodeStats(**json.loads((part / "stats.json").read_text()))
        out[split] = (ExampleStore.load(part), stats)
    return out


def _write(folder: Path, identity: dict[str, Any], splits: Splits) -> None:
    """Stage, list every file's size in the manifest (written last), then rename into place. Another
    builder (a node sharing the filesystem) may have won the race: its complete folder is kept."""
    staging = folder.with_name(f".tmp-{folder.name}-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    files: list[Path] = []
    for split, value in splits.items():
        if value is None:
            continue
        store, stats = value
        part = staging / split
        part.mkdir(parents=True)
        files += store.save(part)
        (part / "stats.json").write_text(json.dumps(asdict(stats)))
        files.append(part / "stats.json")
    sizes = {p.relative_to(staging).as_posix(): p.stat().st_size for p in files}
    meta = {"format": FORMAT, "identity": identity, "files": sizes}
    (staging / MANIFEST).write_text(json.dumps(meta, indent=1, default=str))
    if folder.exists() and _check(folder) is not None:
        shutil.rmtree(folder)  # damaged: replaced
    try:
        os.rename(staging, folder)
    except OSError:
        if _check(folder) is None:  # built meanwhile by another process or node: keep that one
            shutil.rmtree(staging, ignore_errors=True)
            return
        raise
