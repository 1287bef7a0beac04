"""`train.profile: {start, steps}`: torch.profiler over those steps on every rank, a Chrome trace per rank in
`<run>/profile/`, and where the time went (train/profile_summary.py) gathered to rank 0, printed and saved.

It rides on the trainer's hooks: the loop names each phase of a step (data, forward/backward, optimizer)
for its watchdog, and this marks the same phases in the trace."""

from __future__ import annotations

import json
import time
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile, record_function

from shardforge.config.schema import ProfileSection
from shardforge.log import get_logger
from shardforge.train.profile_summary import DATA, OPTIMIZER, STEP, StepBreakdown, breakdown, table

log = get_logger(__name__)

_PHASES = {"data": DATA, "optimizer": OPTIMIZER}  # other phases (forward/backward) need no mark


class StepProfiler:
    """Profiles steps first..last of the loop; attach() registers it on a Trainer's hooks."""

    def __init__(
        self,
        spec: ProfileSection,
        run_dir: Path,
        cuda: bool,
        steps: tuple[int, int],
    ) -> None:
        start_step, total_steps = steps
        self.folder, self.cuda = run_dir / "profile", cuda
        self.first, self.last = max(spec.start, start_step + 1), min(spec.start + spec.steps - 1, total_steps)
        if self.first > self.last:
            log.warning(
                f"train.profile covers steps {spec.start}..{spec.start + spec.steps - 1}, but this run "
                f"trains steps {start_step + 1}..{total_steps}: nothing is profiled"
            )
        elif self.last < spec.start + spec.steps - 1 or self.first > spec.start:
            log.warning(
                f"train.profile: only steps {self.first}..{self.last} are in this run; profiling those"
            )
        self.profiler: profile | None = None
        self.marks: list[AbstractContextManager] = []  # the open step and phase annotations
        self.wall: list[float] = []  # each profiled step's wall time (s), to check the trace against
        self.t0 = 0.0  # when the step being profiled began
        self.summary: list[StepBreakdown] = []

    @classmethod
    def attach(cls, trainer: Any) -> StepProfiler | None:
        """Profile a set-up Trainer's `train.profile` steps (if set) through its phase and step_end hooks."""
        if trainer.config.train.profile is None:
            return None
        cuda, steps = trainer.run.device.type == "cuda", (trainer.start_step, trainer.total_steps)
        profiler = cls(trainer.config.train.profile, trainer.run_dir, cuda, steps)
        trainer.add_hook("phase", profiler.on_phase)
        trainer.add_hook("step_end", profiler.on_step_end)
        return profiler

    def _open(self, name: str) -> None:
        mark = record_function(name)
        mark.__enter__()
        self.marks.append(mark)

    def _close(self, keep: int) -> None:
        while len(self.marks) > keep:
            self.marks.pop().__exit__(None, None, None)

    def on_phase(self, trainer: Any, step: int, tag: str | None) -> None:
        if tag is None or not self.first <= step <= self.last:
            return
        if tag == "data":  # a step begins
            if self.profiler is None:
                activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
                self.profiler = profile(activities=activities)
                self.profiler.start()
            self._synchronize()
            self.t0 = time.perf_counter()
            self._open(STEP)
        self._close(keep=1)  # the previous phase ends
        if tag in _PHASES:
            self._open(_PHASES[tag])

    def on_step_end(self, trainer: Any, step: int, payload: object) -> None:
        if not self.marks:
            return
        self._synchronize()  # the step's kernels belong to it
        self._close(keep=0)
        self.wall.append(time.perf_counter() - self.t0)
        if step == self.last:
            self._finish(dist.get_rank() if dist.is_initialized() else 0)

    def _synchronize(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def _finish(self, rank: int) -> None:
        """Stop, write this rank's trace, summarize it, and gather the summaries on rank 0."""
        assert self.profiler is not None
        self.profiler.stop()
        self.folder.mkdir(parents=True, exist_ok=True)
        trace = self.folder / f"rank{rank}.trace.json"
        self.profiler.export_chrome_trace(str(trace))
        self.profiler = None
        mine = breakdown(json.loads(trace.read_text())["traceEvents"], rank)
        mine.wall_ms = sum(self.wall) / len(self.wall) * 1e3
        parts: list[Any] = [mine]
        if dist.is_initialized():
            parts = [None] * dist.get_world_size() if rank == 0 else []
            dist.gather_object(mine, parts if rank == 0 else None, dst=0)
        if rank != 0:
            return
        self.summary = parts
        text = table(parts)
        (self.folder / "summary.txt").write_text(text + "\n")
        (self.folder / "summary.json").write_text(json.dumps([p.as_dict() for p in parts], indent=2) + "\n")
        where = f"ms per step; Chrome traces in {self.folder}"
        log.info(f"profile of steps {self.first}..{self.last} ({where}):\n{text}")
