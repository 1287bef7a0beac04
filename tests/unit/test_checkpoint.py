"""Checkpoints in one process: exact continuation, commit, retention, damaged checkpoints, the NaN guard."""

from __future__ import annotations

import shutil

import pytest

from shardforge.checkpoint import find_latest, validate
from shardforge.config import load_config
from shardforge.errors import CheckpointError, TrainingError
from shardforge.train.trainer import Trainer
from tests.conftest import alpaca_records, tiny_config, write_jsonl
from tests.dist._training import Interrupted, logged_losses

STEPS = 6


def _config(tmp_path, data, **checkpoint) -> dict:
    cfg = tiny_config(
        tmp_path,
        data,
        train={"steps": STEPS, "micro_batch": 2, "grad_accum": 2, "lr": 3e-3, "warmup": 1, "log_every": 1},
        checkpoint={"every": 2, "keep": 2, "save_final": False, **checkpoint},
    )
    return cfg


def _train_until(cfg: dict, stop_after: int | None, monkeypatch) -> None:
    """Train; with `stop_after`, the process 'dies' right after that step (and its checkpoint, if any)."""
    trainer = Trainer(load_config(None, base=cfg))
    if stop_after is not None:
        original = Trainer.save_checkpoint

        def save_then_die(self, step):
            folder = original(self, step)
            if step >= stop_after:
                raise Interrupted
            return folder

        monkeypatch.setattr(Trainer, "save_checkpoint", save_then_die)
        with pytest.raises(Interrupted):
            trainer.train()
        monkeypatch.undo()
        return
    trainer.train()


@pytest.fixture
def data(tmp_path):
    return write_jsonl(tmp_path / "train.jsonl", alpaca_records(60, seed=3))


@pytest.mark.parametrize("async_save", [False, True])
def test_interrupted_and_resumed_run_matches_bit_for_bit(tmp_path, data, monkeypatch, async_save):
    """With async_save the checkpoint of step 4 is written while step 5 trains: what is saved must still be
    the state after step 4 (the resumed run proves it)."""
    straight = _config(tmp_path / "straight", data)
    _train_until(straight, None, monkeypatch)
    broken = _config(tmp_path / "broken", data, async_save=async_save)
    # Sync: die right after step 4's checkpoint. Async: die right after the save of step 6 was started; that
    # save first completed and committed step 4's, which was written while steps 5 and 6 trained.
    stop = 6 if async_save else 4
    _train_until(broken, stop, monkeypatch)
    reference = logged_losses(tmp_path / "straight" / "run")
    assert logged_losses(tmp_path / "broken" / "run")[-1] == reference[stop - 1]
    root = tmp_path / "broken" / "run" / "checkpoints"
    assert (root / "latest").read_text().strip() == "step-00000004"
    _train_until(broken, None, monkeypatch)  # resume=auto picks step 4 up
    assert logged_losses(tmp_path / "broken" / "run") == reference  # exact, all steps
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-00000004", "step-00000006"]  # keep=2
    assert (root / "latest").read_text().strip() == "step-00000006"


def test_damaged_checkpoints_are_skipped_with_a_warning(tmp_path, data, monkeypatch, capsys, logged_warnings):
    cfg = _config(tmp_path / "a", data, keep=3)
    _train_until(cfg, 4, monkeypatch)
    root = tmp_path / "a" / "run" / "checkpoints"
    newest = root / "step-00000004"
    assert validate(newest) is None
    shard = next(newest.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-10])  # truncated
    warnings = logged_warnings
    assert find_latest(root) == root / "step-00000002"
    assert "step-00000004" in warnings[0] and "truncated" in warnings[0]
    # A save that died before its commit leaves only a staging folder: invisible to resume.
    (root / ".tmp-step-00000006").mkdir()
    (root / "step-00000008").mkdir()  # a folder without a manifest (e.g. copied half-way)
    warnings.clear()
    assert find_latest(root) == root / "step-00000002"
    assert "step-00000008: no manifest.json" in warnings[0] and "step-00000004" in warnings[1]
    # Resuming really starts from step 2 and finishes the run.
    _train_until(cfg, None, monkeypatch)
    out = "".join(capsys.readouterr().out.splitlines())  # whatever the console's width, lines joined
    assert "resumed from" in out and "step-00000002" in out and "(step 2," in out
    assert len(logged_losses(tmp_path / "a" / "run")) == STEPS


def test_resume_from_a_bad_path_is_a_clear_error(tmp_path, data, monkeypatch):
    cfg = _config(tmp_path / "a", data)
    _train_until(cfg, 2, monkeypatch)
    good = tmp_path / "a" / "run" / "checkpoints" / "step-00000002"
    bad = tmp_path / "bad"
    shutil.copytree(good, bad)
    (bad / ".metadata").unlink()
    for path, message in [(tmp_path / "nope", "not a folder"), (bad, ".metadata is missing")]:
        cfg2 = _config(tmp_path / "b", data, resume=str(path))
        with pytest.raises(CheckpointError, match=f"checkpoint.resume=.*{message}"):
            Trainer(load_config(None, base=cfg2)).setup()


def test_non_finite_steps_are_skipped_then_halt(tmp_path, data, monkeypatch):
    import math

    import torch

    from shardforge.objectives.base import CausalLM
    from shardforge.objectives.sft import SFTObjective

    calls = {"n": 0}
    poisoned = {3, 4}  # both micro-steps of step 2

    def sometimes_nan(output, batch):
        calls["n"] += 1
        loss = CausalLM.loss(output, batch)["loss"]
        return {"loss": loss * torch.nan if calls["n"] in poisoned else loss}

    monkeypatch.setattr(SFTObjective, "loss", staticmethod(sometimes_nan))
    trainer = Trainer(load_config(None, base=_config(tmp_path / "a", data, every=None)))
    result = trainer.train()
    assert [r.get("bad_steps", 0) for r in result.history] == [0, 1, 1, 1, 1, 1]
    assert math.isnan(result.history[1]["loss"]) and math.isfinite(result.final_loss)
    assert all(bool(torch.isfinite(p).all()) for p in trainer.model.parameters())  # the update was skipped

    calls["n"], poisoned = 0, set(range(100))
    cfg = _config(tmp_path / "b", data, every=None)
    cfg["train"]["max_bad_steps"] = 2
    with pytest.raises(TrainingError, match=r"training diverged: 2 steps in a row had a non-finite"):
        Trainer(load_config(None, base=cfg)).train()


def test_export_of_a_checkpoint_reloads_in_transformers(tmp_path, data):
    import torch
    from transformers import AutoModelForCausalLM

    from shardforge.checkpoint.export import export_checkpoint

    cfg = _config(tmp_path / "a", data, every=3, save_final=True)
    trainer = Trainer(load_config(None, base=cfg))
    trainer.train()
    _, out, _ = export_checkpoint(tmp_path / "a" / "run", tmp_path / "exported")  # a run: its newest
    ids = torch.randint(0, 1024, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        live = trainer.model(ids)
        theirs = AutoModelForCausalLM.from_pretrained(out).eval()(ids).logits
    torch.testing.assert_close(theirs, live, rtol=1e-4, atol=1e-4)
    assert (out / "tokenizer.json").is_file() or (out / "tokenizer_config.json").is_file()
    # The same weights as the run's own final export.
    final = AutoModelForCausalLM.from_pretrained(tmp_path / "a" / "run" / "final").eval()
    torch.testing.assert_close(final(ids).logits, theirs, rtol=0, atol=0)


_DIE_WHILE_SAVING = """
import os, signal, sys, yaml
import shardforge.checkpoint.trainer_state as ts
from shardforge.config import load_config
from shardforge.train.trainer import Trainer

real_save = ts.dcp.save

def save_and_die_half_way(state, checkpoint_id, **kwargs):
    real_save(state, checkpoint_id=checkpoint_id, **kwargs)
    if "step-00000004" in str(checkpoint_id):
        (checkpoint_id / ".metadata").unlink()  # the shards are on disk, the metadata not yet
        os.kill(os.getpid(), signal.SIGKILL)

ts.dcp.save = save_and_die_half_way
Trainer(load_config(None, base=yaml.safe_load(open(sys.argv[1])))).train()
"""


def test_a_process_killed_while_saving_resumes_from_the_previous_checkpoint(tmp_path, data, monkeypatch):
    import subprocess
    import sys

    import yaml

    from tests.conftest import REPO

    straight = _config(tmp_path / "straight", data)
    _train_until(straight, None, monkeypatch)
    cfg = _config(tmp_path / "killed", data)
    (tmp_path / "killed.yaml").write_text(yaml.safe_dump(cfg))
    proc = subprocess.run(
        [sys.executable, "-c", _DIE_WHILE_SAVING, str(tmp_path / "killed.yaml")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == -9, proc.stderr
    root = tmp_path / "killed" / "run" / "checkpoints"
    assert (root / ".tmp-step-00000004").is_dir() and not (root / "step-00000004").exists()
    assert (root / "latest").read_text().strip() == "step-00000002"
    trainer = Trainer(load_config(None, base=cfg))
    trainer.train()
    assert trainer.start_step == 2
    # the same steps on the same rows: equal to fp32's last bits (the first two steps ran in another process,
    # whose kernels may sum in another order on this CPU; a wrong row or step would be far off)
    straight_losses = logged_losses(tmp_path / "straight" / "run")
    assert logged_losses(tmp_path / "killed" / "run") == pytest.approx(straight_losses, rel=1e-6)
    assert not (root / ".tmp-step-00000004").exists()  # the dead save's leftovers are cleaned up


def test_a_resume_that_would_change_the_run_is_refused_with_every_difference(tmp_path, data, monkeypatch):
    cfg = _config(tmp_path / "a", data)
    _train_until(cfg, 2, monkeypatch)
    changed = _config(tmp_path / "a", data)
    changed["train"].update(micro_batch=4, seed=9)  # another global batch, another data order
    with pytest.raises(CheckpointError) as err:
        Trainer(load_config(None, base=changed)).setup()
    message = str(err.value)
    assert "global_batch: checkpoint 4, this run 8" in message and "set train.global_batch" in message
    assert "seed: checkpoint 0, this run 9" in message


def test_a_checkpoint_of_the_older_optimizer_layout_is_refused_with_advice(tmp_path, data, monkeypatch):
    cfg = _config(tmp_path / "a", data)
    _train_until(cfg, 2, monkeypatch)
    state_file = next((tmp_path / "a" / "run" / "checkpoints").glob("step-*")) / "trainer.json"
    text = state_file.read_text()  # same size after the edit: the manifest still holds
    state_file.write_text(text.replace('"optimizer_format": 2', '"optimizer_format": 1'))
    with pytest.raises(
        CheckpointError, match=r"optimizer_format: checkpoint 1, this run 2 .*shardforge export"
    ):
        Trainer(load_config(None, base=cfg)).setup()


def test_resuming_an_earlier_checkpoint_replaces_the_later_ones(tmp_path, data, monkeypatch, capsys):
    cfg = _config(tmp_path / "a", data, keep=5)
    _train_until(cfg, None, monkeypatch)  # checkpoints at 2, 4, 6
    root = tmp_path / "a" / "run" / "checkpoints"
    again = _config(tmp_path / "a", data, keep=5, resume=str(root / "step-00000002"))
    _train_until(again, 4, monkeypatch)  # resumes at 2, saves 4 again, dies
    # Step 6 belonged to the run this one replaced: gone, so `auto` can never jump back to it.
    assert sorted(p.name for p in root.glob("step-*")) == ["step-00000002", "step-00000004"]
    fresh = _config(tmp_path / "a", data, resume="none")
    Trainer(load_config(None, base=fresh)).setup()
    assert "checkpoint.resume=none: starting fresh" in capsys.readouterr().out
