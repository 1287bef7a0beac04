"""bf16 and fp16 training on the device: a few steps of the trainer (`train.precision`) against transformers'
Llama trained on the same micro-batches in the same precision (autocast to the same dtype; in fp16 with a
loss scale, as the trainer's own scaler does)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from shardforge.data.batching import IGNORE
from tests.dist._training import logged, logged_losses
from tests.training_reference import LR, STEPS, ce_sum, train_ours

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _hf_losses(folder, batches: list, device: torch.device, precision: str) -> list[float]:
    """transformers' model from the same folder, on the device, each step's loss as the trainer logs it (the
    sum over the global batch's targets / their count), AdamW as the trainer sets it (tests/
    training_reference.py's `hf_steps`), the forwards under autocast to the precision's dtype; fp16's loss
    scaled by 2**16 and the gradients unscaled before the step (the trainer's initial scale; no overflow
    in 3 steps of this model, so neither side skips one)."""
    model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sdpa").to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    scale = 2.0**16 if precision == "fp16" else 1.0
    losses = []
    for step in batches:
        count = sum(int((mb.targets != IGNORE).sum()) for mb in step.micro)
        total = 0.0
        for mb in step.micro:
            mb = mb.to(device)
            labels = torch.cat([torch.full_like(mb.targets[:, :1], -100), mb.targets[:, :-1]], dim=1)
            labels = labels.masked_fill(labels == IGNORE, -100)
            with torch.autocast(device.type, dtype=DTYPES[precision]):
                logits = model(input_ids=mb.input_ids, position_ids=mb.position_ids).logits
                loss = ce_sum({"logits": logits}, labels, torch.tensor(count, device=device))
            (loss * scale).backward()
            total += loss.item()
        for p in model.parameters():
            assert torch.isfinite(p.grad).all()
            p.grad.div_(scale)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total)
    return losses


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_low_precision_training_matches_transformers_in_the_same_precision(tmp_path, device, precision):
    """Reference: transformers' Llama on the trainer's own micro-batches, same device, same autocast dtype
    (fp32 weights, low-precision matmuls, fp32 softmax and loss on both sides). The two differ only in
    the order of low-precision roundings (our fused head's chunks vs full logits, our attention and norms
    vs theirs): each of the 3 losses within 2e-3 relative (measured on CPU: 1.4e-5 in bf16, 6e-6 in fp16;
    the margin is for CUDA's kernels, whose choice of algorithm per shape rounds a bf16 product by an ulp,
    ~4e-3, here and there, averaged over hundreds of targets), where a wrong cast, a missed unscale or a
    loss scale left in the logged loss is off by far more. fp16 runs with the trainer's loss scale
    (logged)."""
    trainer, batches = train_ours(tmp_path, train={"precision": precision}, hardware={"device": device.type})
    assert trainer.run.device.type == device.type
    ours = logged_losses(tmp_path / "run")
    theirs = _hf_losses(tmp_path / "base", batches, device, precision)
    assert len(ours) == STEPS
    assert ours == pytest.approx(theirs, rel=2e-3)
    assert ("loss_scale" in logged(tmp_path / "run")[-1]) == (precision == "fp16")
    assert trainer.run.precision.skipped_steps == 0
