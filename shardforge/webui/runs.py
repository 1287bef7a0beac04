"""Runs started from the web UI: the same `shardforge train` a terminal would run, as a subprocess in the
UI's root, its output captured to a log file in the run folder; stopped like Ctrl-C (the trainer's own
interrupt handling), watched through the files every run writes (metrics.jsonl, checkpoints/)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

LOG_NAME = "webui-train.log"
CONFIG_NAME = "webui-config.yaml"


@dataclass
class LaunchedRun:
    run_dir: Path
    command: list[str]
    process: subprocess.Popen
    log: Path
    started: float = field(default_factory=time.time)

    @property
    def running(self) -> bool:
        return self.process.poll() is None

    def status(self) -> str:
        code = self.process.poll()
        elapsed = f"{time.time() - self.started:.0f} s"
        if code is None:
            return f"running ({elapsed}): {' '.join(self.command[2:])}"
        return "finished" if code == 0 else f"ended with exit code {code}"


class RunManager:
    """One launched run at a time (the machine's devices are the job's)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.current: LaunchedRun | None = None

    def launch(
        self, yaml_text: str, run_dir: Path, nproc: int = 1, overrides: tuple[str, ...] = ()
    ) -> LaunchedRun:
        if self.current is not None and self.current.running:
            raise RuntimeError(f"a run is already going ({self.current.run_dir}); stop it first")
        run_dir.mkdir(parents=True, exist_ok=True)
        config = run_dir / CONFIG_NAME
        config.write_text(yaml_text)
        command = [sys.executable, "-m", "shardforge", "train", str(config), *overrides]
        if nproc > 1:
            command += ["--nproc", str(nproc)]
        log = run_dir / LOG_NAME
        with log.open("w") as out:  # the child keeps its own handle
            process = subprocess.Popen(
                command,
                cwd=self.root,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "120"},
                start_new_session=True,  # a stop reaches the whole job (its ranks too)
            )
        self.current = LaunchedRun(run_dir, command, process, log)
        return self.current

    def stop(self, wait: float = 30.0) -> str:
        """Interrupt the run (as Ctrl-C would), then terminate it if it has not ended within `wait` s."""
        run = self.current
        if run is None or not run.running:
            return "no run is going"
        os.killpg(run.process.pid, signal.SIGINT)
        try:
            run.process.wait(wait)
        except subprocess.TimeoutExpired:
            os.killpg(run.process.pid, signal.SIGTERM)
            run.process.wait(10)
        return f"stopped ({run.status()})"


def log_tail(log: Path, lines: int = 60) -> str:
    if not log.is_file():
        return ""
    with log.open("rb") as f:
        f.seek(max(0, f.seek(0, os.SEEK_END) - 64_000))
        text = f.read().decode("utf-8", errors="replace")
    return "\n".join(text.replace("\r", "\n").splitlines()[-lines:])


def checkpoints(run_dir: Path) -> list[str]:
    """The run's complete checkpoints, newest first (what `checkpoint.resume` may name)."""
    folder = run_dir / "checkpoints"
    if not folder.is_dir():
        return []
    done = [p for p in folder.iterdir() if p.is_dir() and p.name.startswith("step-")]
    return [str(p) for p in sorted(done, reverse=True)]


def run_folders(root: Path, depth: int = 4) -> list[str]:
    """Run folders under the root (those with a metrics.jsonl), relative, for the curves' comparison."""
    found = [
        p.parent.relative_to(root).as_posix()
        for p in sorted(root.glob("**/metrics.jsonl"))
        if len(p.relative_to(root).parts) <= depth + 1 and not any(s.startswith(".") for s in p.parts)
    ]
    return found[:200]
