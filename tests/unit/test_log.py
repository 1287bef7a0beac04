"""The library's one logger: rank 0's records by default, every rank's (named) on request, warnings
prefixed, messages taken as plain text."""

from __future__ import annotations

import io
import logging

import pytest
from rich.console import Console

from shardforge.log import get_logger, log_to_console


@pytest.fixture(autouse=True)
def _restored():
    """The library logger as it was: other tests' output goes where their runs send it."""
    logger = logging.getLogger("shardforge")
    kept = (list(logger.handlers), logger.level, logger.propagate)
    yield
    logger.handlers[:], logger.level, logger.propagate = kept[0], kept[1], kept[2]


def _said(monkeypatch, rank: int, all_ranks: bool) -> str:
    monkeypatch.setenv("RANK", str(rank))
    out = io.StringIO()
    log_to_console(Console(file=out, width=200, color_system=None), all_ranks=all_ranks)
    log = get_logger("shardforge.test")
    log.info("train data: 12 rows [of 3 files]")
    log.warning("the global batch is larger than the training data")
    return out.getvalue()


def test_rank_zero_speaks_and_the_others_are_quiet(monkeypatch):
    assert _said(monkeypatch, 0, False) == (
        "train data: 12 rows [of 3 files]\nwarning: the global batch is larger than the training data\n"
    )
    assert _said(monkeypatch, 1, False) == ""


def test_every_rank_names_itself_when_asked(monkeypatch):
    said = _said(monkeypatch, 1, True)
    assert said.splitlines() == [
        "[rank 1] train data: 12 rows [of 3 files]",
        "[rank 1] warning: the global batch is larger than the training data",
    ]


def test_a_module_logger_is_a_child_of_the_librarys():
    assert get_logger("shardforge.data.build").parent.name == "shardforge"
    assert get_logger("elsewhere").name == "shardforge.elsewhere"


def test_collected_takes_the_messages_of_a_block_and_leaves_the_logger_as_it_was():
    from shardforge.log import collected

    logger = logging.getLogger("shardforge")
    before = (list(logger.handlers), logger.level)
    log = get_logger("shardforge.test")
    with collected() as warnings, collected(logging.INFO) as everything:
        log.info("tokenizing into the dataset cache")
        log.warning("skipping checkpoint step-4: truncated")
    log.warning("after the block")
    assert warnings == ["skipping checkpoint step-4: truncated"]
    assert everything == ["tokenizing into the dataset cache", "skipping checkpoint step-4: truncated"]
    assert (list(logger.handlers), logger.level) == before
