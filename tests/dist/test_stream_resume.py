"""Streamed training (data.streaming): a 2-rank run stopped after a checkpoint and resumed in one process
trains on exactly the rows, and gives exactly the losses, of an uninterrupted one-process run, across windows,
shards and an epoch; and a corpus that fits in one window trains exactly as the in-memory pipeline does."""

from __future__ import annotations

import shutil

import pytest

from shardforge.checkpoint.trainer_state import read_trainer_state
from shardforge.config import load_config
from shardforge.train.trainer import Trainer
from tests.conftest import tiny_config, write_jsonl
from tests.dist._harness import run_ranks
from tests.dist._training import Interrupted, logged_losses, parity_train

STEPS, STOP = 6, 2


def _cfg(out, corpus, *, mb: int, accum: int, streaming: bool = True, window: int = 16) -> dict:
    return tiny_config(
        out,
        corpus,
        "text",
        data={"streaming": streaming, "stream_window": window, "max_length": 64},
        method={"stage": "pt"},
        train=parity_train(STEPS, mb, accum),
        checkpoint={"every": 2, "save_final": False},
    )


def _train(cfg: dict, stop_after: int | None = None) -> dict:
    original = Trainer.save_checkpoint

    def save(self, step):
        folder = original(self, step)
        if stop_after is not None and step >= stop_after:
            raise Interrupted
        return folder

    Trainer.save_checkpoint = save
    trainer = Trainer(load_config(None, base=cfg))
    try:
        trainer.train()
    except Interrupted:
        pass
    finally:
        Trainer.save_checkpoint = original
    return {"start": trainer.start_step, "data": trainer.loader.state_dict()}


def _jobs(jobs: list[tuple[dict, int | None]]) -> list[dict]:
    return [_train(cfg, stop) for cfg, stop in jobs]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("stream")
    corpus = tmp / "corpus"
    corpus.mkdir()
    write_jsonl(corpus / "a.jsonl", [{"text": f"doc {i} " + "word " * (4 + i % 23)} for i in range(60)])
    (corpus / "b.txt").write_text("".join(f"line {i} " + "more " * (i % 17) + "\n" for i in range(40)))
    # 2 ranks (DDP, global batch 2 x 2 x 2 = 8), stopped after the checkpoint of step 2.
    two = run_ranks(_jobs, 2, [(_cfg(tmp / "from2", corpus, mb=2, accum=2), STOP)])[0]
    straight = _train(_cfg(tmp / "straight", corpus, mb=4, accum=2))  # one process, same global batch
    resumed = _train(_cfg(tmp / "from2", corpus, mb=4, accum=2))  # resume=auto: the 2-rank checkpoint
    whole = tmp / "whole"  # one window holds the corpus: streamed vs in memory
    for name in ("stream", "memory"):
        _train(_cfg(whole / name, corpus, mb=4, accum=2, streaming=name == "stream", window=1000))
    shutil.rmtree(tmp / "straight" / "run" / "checkpoints")
    return {"tmp": tmp, "two": two, "straight": straight, "resumed": resumed, "whole": whole}


def test_a_stream_resumed_on_another_world_size_continues_exactly(runs):
    tmp = runs["tmp"]
    assert runs["two"][0]["start"] == 0 and runs["resumed"]["start"] == STOP
    saved = read_trainer_state(tmp / "from2" / "run" / "checkpoints" / f"step-{STOP:08d}")["data"]
    assert saved["row"] > 0 and saved["window"] > 0  # it resumed inside a window, not at its start
    assert runs["resumed"]["data"] == runs["straight"]["data"]  # the same position at the end
    assert runs["straight"]["data"]["epoch"] >= 1 and runs["straight"]["data"]["samples"] == STEPS * 8
    straight = logged_losses(tmp / "straight" / "run")
    resumed = logged_losses(tmp / "from2" / "run")  # steps 1-2 on two ranks, 3-6 in one process
    assert len(straight) == len(resumed) == STEPS
    assert resumed == pytest.approx(straight, rel=1e-5)


def test_a_corpus_in_one_window_trains_as_in_memory(runs):
    whole = runs["whole"]
    streamed, memory = logged_losses(whole / "stream" / "run"), logged_losses(whole / "memory" / "run")
    assert len(streamed) == STEPS and streamed == pytest.approx(memory, rel=1e-6)
