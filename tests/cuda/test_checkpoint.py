"""Checkpoints from the device: a run stopped right after a checkpoint and resumed from it (the weights,
optimizer states and data position read back onto the device) continues with the uninterrupted run's
losses."""

from __future__ import annotations

import pytest

from tests.cuda.common import device_config, trained_losses
from tests.dist._training import logged_losses, stopped_and_resumed


def test_a_resumed_run_continues_with_the_uninterrupted_losses(tmp_path, device):
    """Reference: the same 6 steps uninterrupted on the same device, fp32 (tests/unit/test_checkpoint.py's
    check). On the CPU exactly equal, the Determinism contract (docs/DESIGN.md). On CUDA within 1e-5
    relative: a resumed process runs the same kernels on the same values, but some CUDA backward kernels
    (the embedding's gradient, attention's) accumulate with atomics in no fixed order, so two runs may
    differ in the last bits; a state not restored (Adam's moments, the step count of the schedule, the
    data position) moves the next loss by 1e-3 or more."""
    train = {"steps": 6, "micro_batch": 2, "grad_accum": 2, "lr": 3e-3, "warmup": 1}
    checkpoint = {"every": 2, "keep": 2, "save_final": False}
    straight, _ = trained_losses(
        device_config(tmp_path, "straight", device, train=train, checkpoint=checkpoint)
    )
    cfg = device_config(tmp_path, "broken", device, train=train, checkpoint=checkpoint)
    resumed = stopped_and_resumed(cfg, 4)
    assert resumed.run.device.type == device.type
    losses = logged_losses(tmp_path / "broken" / "run")
    assert len(straight) == 6 and len(losses) == 6  # 4 before the stop, 2 after the resume
    tolerance = 0 if device.type == "cpu" else 1e-5
    assert losses == pytest.approx(straight, rel=tolerance, abs=0)
