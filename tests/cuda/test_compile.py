"""`train.compile` on the device: the compiled model (torch.compile, inductor) trains as eager does."""

from __future__ import annotations

import pytest

from tests.cuda.common import device_config, trained_losses


def test_compiled_training_matches_eager(tmp_path, device):
    """Reference: the same run in eager mode on the same device, fp32 (tests/unit/test_trainer.py's
    `test_compile_matches_eager`). Inductor fuses the element-wise work and reorders reductions (on CUDA:
    Triton kernels), so the losses of 2 steps agree within 1e-4 relative, not bit for bit; a graph that
    dropped a term (a norm, the RoPE, a residual) or mis-ordered the steps is off by far more."""
    train = {"steps": 2, "micro_batch": 2, "grad_accum": 1}
    eager, _ = trained_losses(device_config(tmp_path, "eager", device, train=train))
    compiled, trainer = trained_losses(
        device_config(tmp_path, "compiled", device, train={**train, "compile": True})
    )
    assert trainer.run.device.type == device.type
    assert all(block._compiled_call_impl is not None for block in trainer.engine.inner.blocks())
    assert len(compiled) == 2
    assert compiled == pytest.approx(eager, rel=1e-4)
