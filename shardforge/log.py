"""The library's one logger ("shardforge" and its children), rank-aware: by default only rank 0's records are
shown (every rank runs the same code and would say the same thing), all ranks' on request (`log.all_ranks`,
each line then names its rank). Library code logs (`get_logger(__name__).info(...)`, `.warning(...)`); it
never prints and never takes a console or a callback to say things through. A face (the CLI, `train()`)
routes the records to its rich console with `log_to_console`; without that, Python's logging defaults apply
(warnings and errors to stderr)."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator

from rich.console import Console
from rich.text import Text

ROOT = "shardforge"


def get_logger(name: str) -> logging.Logger:
    """The logger of a module (`__name__`), a child of the library's."""
    return logging.getLogger(name if name.startswith(ROOT) else f"{ROOT}.{name}")


def current_rank() -> int:
    """This process's global rank (0 when it is the only one)."""
    dist = sys.modules.get("torch.distributed")  # never imported for this: config errors import no torch
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


class RankFilter(logging.Filter):
    """Rank 0's records, or every rank's (named) with `all_ranks`."""

    def __init__(self, all_ranks: bool = False) -> None:
        super().__init__()
        self.all_ranks = all_ranks

    def filter(self, record: logging.LogRecord) -> bool:
        rank = current_rank()
        record.rank = rank
        return self.all_ranks or rank == 0


class ConsoleHandler(logging.Handler):
    """Records as lines on a rich console: warnings and errors prefixed, never hard-wrapped, the message
    taken as plain text (a path with brackets is not markup)."""

    def __init__(self, console: Console, all_ranks: bool = False) -> None:
        super().__init__()
        self.console, self.all_ranks = console, all_ranks
        self.addFilter(RankFilter(all_ranks))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = Text()
            if self.all_ranks:
                line.append(f"[rank {getattr(record, 'rank', 0)}] ")
            if record.levelno >= logging.ERROR:
                line.append("error: ", style="red")
            elif record.levelno >= logging.WARNING:
                line.append("warning: ", style="yellow")
            line.append(record.getMessage())
            self.console.print(line, soft_wrap=True)
        except Exception:  # logging must never take the run down
            self.handleError(record)


def log_to_console(console: Console, all_ranks: bool = False, level: int = logging.INFO) -> None:
    """Show the library's records of `level` and above on `console` (replacing an earlier console)."""
    logger = logging.getLogger(ROOT)
    for handler in [h for h in logger.handlers if isinstance(h, ConsoleHandler)]:
        logger.removeHandler(handler)
    logger.addHandler(ConsoleHandler(console, all_ranks))
    logger.setLevel(level)
    logger.propagate = False


@contextlib.contextmanager
def collected(level: int = logging.WARNING) -> Iterator[list[str]]:
    """The library's messages of `level` and above while the block runs, this rank's, for a face that shows
    them itself (the web UI's export) or a test."""
    messages: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    logger, handler = logging.getLogger(ROOT), Collect(level)
    was = logger.level
    if logger.getEffectiveLevel() > level:
        logger.setLevel(level)
    logger.addHandler(handler)
    try:
        yield messages
    finally:
        logger.removeHandler(handler)
        logger.setLevel(was)
