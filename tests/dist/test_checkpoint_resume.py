"""Checkpoints across ranks: bit-exact continuation on the same layout, and resuming a 4-rank FSDP2 x TP2 run
on 2 ranks (ZeRO-3, ZeRO-1, PP2) and on 1 process, with every sample of an epoch seen exactly once; a 4-rank
PP2 x TP2 run resumes under PP, without PP and in one process, and exports like the other layouts."""

from __future__ import annotations

import shutil

import pytest
import torch
from torch.distributed.tensor import DTensor

from shardforge.config import load_config
from shardforge.data.batching import GlobalOrder
from shardforge.train.trainer import Trainer
from tests.conftest import alpaca_records, tiny_config, write_jsonl
from tests.dist._harness import run_ranks
from tests.dist._training import Interrupted, logged_losses, parity_train

STEPS, STOP = 6, 4
IDS = torch.arange(2, 26).view(2, 12)


def _cfg(out, data, *, mb: int, accum: int = 2, **parallel) -> dict:
    return tiny_config(
        out,
        data,
        train=parity_train(STEPS, mb, accum),
        parallel=parallel,
        checkpoint={"every": 2, "save_final": False},
    )


def _run(cfg: dict, stop_after: int | None) -> dict:
    """Train on this rank (dying right after the checkpoint of `stop_after`); returns the global row ids of
    the steps this process completed, in order, and the number of rows of the dataset."""
    takes: list[list[int]] = []
    original_take, original_save = GlobalOrder.take, Trainer.save_checkpoint

    def take(self, count):
        ids = original_take(self, count)
        takes.append(ids.tolist())
        return ids

    def save(self, step):
        folder = original_save(self, step)
        if stop_after is not None and step >= stop_after:
            raise Interrupted
        return folder

    GlobalOrder.take, Trainer.save_checkpoint = take, save
    trainer = Trainer(load_config(None, base=cfg))
    logits = None
    try:
        trainer.train()
    except Interrupted:  # the live model's logits, to compare with its exported checkpoint
        if not trainer.engine.is_pipeline:  # (a pipeline stage is no whole model to call)
            with torch.no_grad():
                logits = trainer.model(IDS)
            logits = logits.full_tensor() if isinstance(logits, DTensor) else logits
    finally:
        GlobalOrder.take, Trainer.save_checkpoint = original_take, original_save
    done = (
        trainer.samples_seen - (trainer.start_step * trainer.run.global_batch)
    ) // trainer.run.global_batch
    return {
        "ids": takes[:done],
        "rows": len(trainer.run.train_rows.rows),
        "start": trainer.start_step,
        "logits": logits,
    }


def _runs(jobs: list[tuple[dict, int | None]]) -> list[dict]:
    return [_run(cfg, stop) for cfg, stop in jobs]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ckpt")
    data = write_jsonl(tmp / "train.jsonl", alpaca_records(80, seed=5))
    # 4 ranks, FSDP2 x TP2 (global batch 2 x 2 x 2 = 8), and PP2 x TP2 (4 x 2 x 1 = 8), each dying after
    # the checkpoint of step 4.
    four, pp_four = run_ranks(
        _runs,
        4,
        [
            (_cfg(tmp / "from4", data, mb=2, tp=2, zero_stage=3), STOP),
            (_cfg(tmp / "pp_from4", data, mb=4, pp=2, tp=2), STOP),
        ],
    )[0]
    for target in ("to2", "to1", "to_zero1", "to_pp"):
        shutil.copytree(tmp / "from4", tmp / target)
    for target in ("pp_to_pp", "pp_to2", "pp_to1"):
        shutil.copytree(tmp / "pp_from4", tmp / target)
    jobs = [
        (_cfg(tmp / "straight", data, mb=2, zero_stage=3), None),  # 2 ranks ZeRO-3, uninterrupted
        (_cfg(tmp / "broken", data, mb=2, zero_stage=3), STOP),
        (_cfg(tmp / "broken", data, mb=2, zero_stage=3), None),  # resume=auto: same layout
        (_cfg(tmp / "to2", data, mb=2, zero_stage=3), None),  # resumes the 4-rank checkpoint on 2 ranks
        (_cfg(tmp / "to_zero1", data, mb=2, zero_stage=1), None),  # ... on 2 ranks with ZeRO-1
        # Optimizers with states of their own layout: ZeRO-1 (whole states per owner rank), offload.
        (_cfg(tmp / "zero1", data, mb=2, zero_stage=1), STOP),
        (_cfg(tmp / "offload", data, mb=2, zero_stage=3, offload="optimizer"), STOP),
        # Pipelined checkpoints: PP2 x TP2 -> PP2, -> ZeRO-3 without PP; and FSDP2 x TP2 -> PP2.
        (_cfg(tmp / "pp_to_pp", data, mb=4, pp=2, pp_schedule="gpipe"), None),
        (_cfg(tmp / "pp_to2", data, mb=2, zero_stage=3), None),
        (_cfg(tmp / "to_pp", data, mb=4, pp=2), None),
    ]
    two = run_ranks(_runs, 2, jobs)[0]
    shutil.copytree(tmp / "zero1", tmp / "zero1_to3")
    shutil.copytree(tmp / "offload", tmp / "offload_to1")
    two += run_ranks(_runs, 2, [(_cfg(tmp / "zero1_to3", data, mb=2, zero_stage=3), None)])[0]
    one = _run(_cfg(tmp / "to1", data, mb=4), None)  # ... and in one process (global batch 4 x 2 = 8)
    _run(_cfg(tmp / "pp_to1", data, mb=4), None)
    offload_to1 = _run(_cfg(tmp / "offload_to1", data, mb=4), None)
    return {"tmp": tmp, "four": four, "pp_four": pp_four, "two": two, "one": one, "offload_to1": offload_to1}


def test_same_layout_resume_is_bit_exact(runs):
    tmp = runs["tmp"]
    assert runs["two"][2]["start"] == STOP
    # every step, to the last bit
    assert logged_losses(tmp / "broken" / "run") == logged_losses(tmp / "straight" / "run")


@pytest.mark.parametrize(
    ("target", "saved_by"),
    [
        ("to2", "4 ranks FSDP2 x TP2 -> 2 ranks ZeRO-3"),
        ("to1", "4 ranks FSDP2 x TP2 -> 1 process"),
        ("to_zero1", "4 ranks FSDP2 x TP2 -> 2 ranks ZeRO-1"),
        ("zero1_to3", "2 ranks ZeRO-1 -> 2 ranks ZeRO-3"),
        ("offload_to1", "2 ranks ZeRO-3 + offloaded optimizer -> 1 process"),
        ("pp_to_pp", "4 ranks PP2 x TP2 -> 2 ranks PP2 (another schedule)"),
        ("pp_to2", "4 ranks PP2 x TP2 -> 2 ranks ZeRO-3 without PP"),
        ("pp_to1", "4 ranks PP2 x TP2 -> 1 process"),
        ("to_pp", "4 ranks FSDP2 x TP2 -> 2 ranks PP2"),
    ],
)
def test_resume_on_another_layout_continues_the_run(runs, target, saved_by):
    tmp = runs["tmp"]
    reference = logged_losses(tmp / "straight" / "run")
    assert logged_losses(tmp / target / "run") == pytest.approx(reference, rel=1e-5), saved_by


@pytest.mark.parametrize("target", ["to2", "to1"])
def test_every_sample_of_an_epoch_is_seen_exactly_once(runs, target):
    resumed = runs["two"][3] if target == "to2" else runs["one"]
    ids = [i for step in runs["four"]["ids"] + resumed["ids"] for i in step]
    rows = resumed["rows"]
    assert len(ids) == STEPS * 8 > rows  # the run crosses into the second epoch
    assert sorted(ids[:rows]) == list(range(rows))
    assert ids == GlobalOrder(rows, 0).take(STEPS * 8).tolist()  # the very order of the uninterrupted run


def test_export_of_the_sharded_checkpoint_matches_the_live_model(runs):
    """The 4-rank FSDP2 x TP2 checkpoint of step 4, exported in one process, gives the logits the live sharded
    model gave at that step."""
    from transformers import AutoModelForCausalLM

    from shardforge.checkpoint.export import export_checkpoint

    tmp = runs["tmp"]
    _, out, _ = export_checkpoint(tmp / "from4" / "run", tmp / "exported")
    with torch.no_grad():
        theirs = AutoModelForCausalLM.from_pretrained(out).eval()(IDS).logits
    torch.testing.assert_close(theirs, runs["four"]["logits"], rtol=1e-4, atol=1e-4)


def test_export_of_a_pipelined_checkpoint_matches_the_other_layouts(runs):
    """The PP2 x TP2 checkpoint of step 4 (each stage saved its own layers) exports to the model the FSDP2 x
    TP2 run had at that step, as transformers computes it."""
    from transformers import AutoModelForCausalLM

    from shardforge.checkpoint.export import export_checkpoint

    tmp = runs["tmp"]
    assert runs["pp_four"]["start"] == 0 and len(runs["pp_four"]["ids"]) == STOP
    _, out, _ = export_checkpoint(tmp / "pp_from4" / "run", tmp / "pp_exported")
    with torch.no_grad():
        theirs = AutoModelForCausalLM.from_pretrained(out).eval()(IDS).logits
    torch.testing.assert_close(theirs, runs["four"]["logits"], rtol=1e-4, atol=1e-4)
