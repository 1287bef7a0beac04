"""Hang and timeout diagnosis for distributed runs.

A rank that stops making progress (stuck in a collective that never completes, or anywhere else) is found by a
watchdog thread: it prints which rank was doing what (the loop marks each phase, e.g. "step 12: backward of
micro-step 2 (gradient reduce-scatter)"), dumps every thread's Python stack with faulthandler and exits
non-zero, so the launcher tears the job down (or restarts it) instead of waiting forever. A collective that
times out inside torch raises on its rank; the trainer's `train()` prints the same line and stacks (`dump`)
before it ends.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time


class Watchdog:
    def __init__(self, rank: int, timeout_s: float) -> None:
        self.rank, self.timeout_s = rank, timeout_s
        self.phase = "starting"
        self._last = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="shardforge-watchdog", daemon=True)
        self._thread.start()

    def beat(self, phase: str) -> None:
        """Progress: the rank is now doing `phase`."""
        self.phase, self._last = phase, time.monotonic()

    def stop(self) -> None:
        self._stop.set()

    def describe(self) -> str:
        waited = time.monotonic() - self._last
        return f"rank {self.rank} has waited {waited:.0f} s in: {self.phase}"

    def _watch(self) -> None:
        while not self._stop.wait(min(5.0, self.timeout_s / 4)):
            if time.monotonic() - self._last > self.timeout_s:
                dump(f"shardforge watchdog: no progress for {self.timeout_s:.0f} s; {self.describe()}")
                os._exit(3)


def dump(line: str) -> None:
    """The diagnosis line, then every thread's Python stack, on stderr."""
    sys.stderr.write(line + "\n--- Python stacks of every thread on this rank:\n")
    sys.stderr.flush()
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    sys.stderr.flush()


def is_timeout(exc: BaseException) -> bool:
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and ("timed out" in text or "timeout" in text)
