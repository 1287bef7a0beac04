"""The one loop: split-invariant batches, accumulation, schedules, precision modes, checkpointing, outputs."""

from __future__ import annotations

import json
import math

import pytest
import torch

from shardforge.config import load_config
from shardforge.config.schema import TrainSection
from shardforge.models import load_model
from shardforge.train.optim import lr_factor
from shardforge.train.trainer import Trainer, train
from tests.conftest import alpaca_records, tiny_config, write_jsonl


def _run(tmp_path, name, **sections):
    data = write_jsonl(tmp_path / "train.jsonl", alpaca_records(40))
    cfg = tiny_config(tmp_path / name, data, **sections)
    trainer = Trainer(load_config(None, base=cfg))
    trainer.train()
    losses = [
        json.loads(line)["loss"]
        for line in (tmp_path / name / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    return losses, trainer.model


def test_split_of_global_batch_does_not_change_loss_or_update(tmp_path):
    """Same global batch (4 rows) as 4x1, 2x2 and 1x4: per-step loss and final weights agree (mean over
    all target tokens of the global batch, not a mean of micro-batch means; rows have unequal target
    counts)."""
    runs = {
        split: _run(
            tmp_path, f"s{split[0]}x{split[1]}", train={"micro_batch": split[0], "grad_accum": split[1]}
        )
        for split in [(4, 1), (2, 2), (1, 4)]
    }
    (ref_losses, ref_model), *others = runs.values()
    assert len(ref_losses) == 4
    for losses, model in others:
        assert losses == pytest.approx(ref_losses, rel=1e-5)
        for a, b in zip(ref_model.parameters(), model.parameters(), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_activation_checkpointing_gives_identical_losses(tmp_path):
    plain, _ = _run(tmp_path, "none")
    ckpt, model = _run(tmp_path, "full", parallel={"activation_checkpoint": "full"})
    assert ckpt == pytest.approx(plain, rel=1e-6)
    assert type(model.layers[0]).__name__ == "CheckpointWrapper"


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_low_precision_modes_train(tmp_path, precision):
    """Compared with the same precision, not with fp32: the global batch split 4x1 and 2x2 gives the same
    run to low-precision noise (measured: 3e-5 relative), which a wrong accumulation or normalization would
    not; the fresh model starts at ln(vocabulary) and the loss falls by over a nat in 6 steps."""
    train = {"precision": precision, "steps": 6, "lr": 3e-3}
    whole, _ = _run(tmp_path, f"{precision}4x1", train={**train, "micro_batch": 4, "grad_accum": 1})
    split, _ = _run(tmp_path, f"{precision}2x2", train={**train, "micro_batch": 2, "grad_accum": 2})
    assert split == pytest.approx(whole, rel=2e-4)
    assert whole[0] == pytest.approx(math.log(1024), abs=0.1) and whole[0] - whole[-1] > 1.0
    record = json.loads((tmp_path / f"{precision}2x2" / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert ("loss_scale" in record) == (precision == "fp16")


def test_logged_lr_is_the_rate_the_step_used(tmp_path):
    """Warmup as docs/config.md states it: step k (0-based) of `warmup` runs at lr x (k+1)/(warmup+1)."""
    _run(tmp_path, "lr", train={"steps": 3, "warmup": 4, "lr": 1.0, "schedule": "constant"})
    records = [json.loads(x) for x in (tmp_path / "lr" / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["lr"] for r in records] == pytest.approx([0.2, 0.4, 0.6])


def test_lr_schedules():
    t = TrainSection(lr=1.0, warmup=4, schedule="cosine", min_lr_ratio=0.1)
    assert lr_factor(0, 100, t) == pytest.approx(0.2) and lr_factor(3, 100, t) == pytest.approx(0.8)
    assert lr_factor(4, 100, t) == pytest.approx(1.0) and lr_factor(100, 100, t) == pytest.approx(0.1)
    lin = TrainSection(lr=1.0, warmup=0, schedule="linear", min_lr_ratio=0.0)
    assert lr_factor(50, 100, lin) == pytest.approx(0.5)
    assert lr_factor(77, 100, TrainSection(schedule="constant", warmup=0)) == 1.0


def test_epochs_set_the_step_count_and_outputs_exist(tmp_path):
    data = write_jsonl(tmp_path / "train.jsonl", alpaca_records(30))
    cfg = tiny_config(
        tmp_path,
        data,
        train={"epochs": 2, "steps": None, "micro_batch": 4},
        data={"packing": False, "eval_fraction": 0.2},
        log={"tensorboard": True, "plot": True},
        hardware={"peak_flops": None},  # the measured peak, as a real run on this machine uses
    )
    result = train(load_config(None, base=cfg))
    assert result.steps == 12  # 24 rows (after 6 held out) x 2 epochs / 4 rows per step
    run = result.run_dir
    for name in [
        "config.yaml",
        "metrics.jsonl",
        "loss.png",
        "final/config.json",
        "final/model.safetensors",
        "final/tokenizer.json",
    ]:
        assert (run / name).is_file(), name
    assert any((run / "tensorboard").iterdir())
    record = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    assert {
        "step",
        "loss",
        "lr",
        "grad_norm",
        "tokens_per_s",
        "target_tokens_per_s",
        "mfu",
        "eval_loss",
    } <= set(record)
    assert 0 < record["mfu"] <= 1 and record["target_tokens_per_s"] < record["tokens_per_s"]
    first = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    assert first["peak_source"].startswith("measured: best of") and first["peak_flops"] > 1e9
    reloaded = load_model(run / "final")
    assert reloaded.config.vocab_size == 1024


@pytest.mark.slow
def test_compile_matches_eager(tmp_path):
    eager, _ = _run(tmp_path, "eager", train={"steps": 2})
    compiled, _ = _run(tmp_path, "compiled", train={"steps": 2, "compile": True})
    assert compiled == pytest.approx(eager, rel=1e-4)


def test_library_console_never_hard_wraps(capsys, monkeypatch):
    """Paths in logs (SLURM files, CI, pytest's capture) must stay on one line whatever the width: a console
    that is not a terminal would otherwise wrap at 80 columns."""
    from shardforge.train.runtime import console_for

    monkeypatch.setenv("COLUMNS", "40")
    path = "/runs/" + "deep/" * 40 + "checkpoints/step-00000002"
    console_for().print(f"resumed from {path} (step 2, 8 samples seen)")
    assert path in capsys.readouterr().out


def test_hooks_see_every_step_log_eval_and_save(tmp_path):
    data = write_jsonl(tmp_path / "train.jsonl", alpaca_records(40))
    cfg = tiny_config(
        tmp_path,
        data,
        train={"steps": 4, "log_every": 2, "eval_every": 4},
        data={"eval_fraction": 0.2},
        checkpoint={"every": 2, "save_final": False},
    )
    trainer = Trainer(load_config(None, base=cfg))
    seen: dict[str, list[int]] = {event: [] for event in ("step_end", "log", "eval", "save")}
    for event, steps in seen.items():
        trainer.add_hook(event, lambda _trainer, step, _payload, steps=steps: steps.append(step))
    trainer.train()
    assert seen == {"step_end": [1, 2, 3, 4], "log": [2, 4], "eval": [4], "save": [2, 4]}
    with pytest.raises(ValueError, match="unknown hook 'epoch'"):
        trainer.add_hook("epoch", print)


def test_an_mfu_above_one_is_reported_not_logged_silently(logged_warnings):
    """A peak below what the steps achieved (a probe taken on a busy machine) is flagged in the warning,
    and the peak and its source are in the first record only."""
    from shardforge.objectives.base import CausalLM
    from shardforge.train.metrics import MetricsProcessor

    warnings = logged_warnings
    metrics = MetricsProcessor(
        CausalLM,
        lambda t, s, p, patches=0: 1e12,
        (1e9, "a bad probe"),
        1,
        torch.device("cpu"),
        None,
        None,
        {},
    )
    counts = {"tokens": 100, "targets": 50, "attention_pairs": 1000}
    metrics.add({"loss": torch.tensor(100.0)}, counts)
    first = metrics.record(1, lambda t: t)
    assert first["loss"] == 2.0 and first["peak_source"] == "a bad probe" and first["mfu"] > 1
    assert "MFU" in warnings[0] and "a bad probe" in warnings[0] and "hardware.peak_flops" in warnings[0]
    metrics.add({"loss": torch.tensor(100.0)}, counts)
    assert "peak_flops" not in metrics.record(2, lambda t: t)
