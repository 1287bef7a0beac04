"""QLoRA on the device: LoRA over the NF4 base (its block linears 4-bit, quantized as they are read onto
the device) trains as LoRA over the base those NF4 weights dequantize to."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shardforge.adapters.apply import add_lora
from shardforge.adapters.lora import LoRALinear
from shardforge.config.method_schema import LoraSection
from shardforge.models import load_model
from shardforge.models.quantize import dequantized, is_nf4
from tests.dist._training import tiny_model_folder

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _with_lora(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """LoRA (rank 8) on every block linear, B drawn nonzero from a fixed generator (a fresh B is zero, and
    then A has no gradient): the same adapters on both models."""
    add_lora(model, LoraSection(rank=8, alpha=16.0), seed=0)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, LoRALinear):
                module.lora_B.copy_(torch.randn(module.lora_B.shape, generator=g) * 0.05)
    return [p for p in model.parameters() if p.requires_grad]


def _steps(model: torch.nn.Module, ids: torch.Tensor) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Two AdamW steps of next-token cross-entropy on the adapters: the losses, and the first gradients."""
    trained = _with_lora(model)
    optimizer = torch.optim.AdamW(trained, lr=1e-2)
    losses, grads = [], {}
    for step in range(2):
        logits = model(ids)[:, :-1]
        loss = F.cross_entropy(logits.float().flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        if step == 0:
            grads = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, grads


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_lora_over_nf4_equals_lora_over_the_dequantized_base(tmp_path, device, dtype):
    """Reference: the same model with plain weights set to what the NF4 weights dequantize to (the base
    the quantized model computes with), the same adapters, on the same device and dtype. Both take the
    same products; NF4's linear dequantizes the weight and runs the dtype's matmul, so fp32 agrees within
    1e-5 and bf16 within 1e-3 on the losses and 1e-2 relative on the adapters' gradients (bf16 rounding of
    the same products in another order; measured on CPU: exact in both). Not a comparison with the
    unquantized base: NF4's error is tests/unit/test_qlora.py's."""
    base = tiny_model_folder(tmp_path, 1024, seed=4, num_layers=2, num_kv_heads=2, family="llama")
    quantized = load_model(base["path"], dtype=DTYPES[dtype], device=device, quantize=True)
    reference = load_model(base["path"], dtype=DTYPES[dtype], device=device)
    plain = dict(reference.named_parameters())
    nf4 = [name for name, p in quantized.named_parameters() if is_nf4(p)]
    assert len(nf4) == 2 * 7
    with torch.no_grad():
        for name in nf4:
            weight = quantized.get_parameter(name)
            assert weight.device.type == device.type
            plain[name].copy_(dequantized(weight))
    ids = torch.randint(0, 1000, (2, 24), generator=torch.Generator().manual_seed(0)).to(device)
    losses, grads = _steps(quantized, ids)
    expected, expected_grads = _steps(reference, ids)
    assert grads.keys() == expected_grads.keys() and all("lora_" in name for name in grads)
    loss_tol, grad_tol = (1e-5, 1e-5) if dtype == "fp32" else (1e-3, 1e-2)
    assert losses == pytest.approx(expected, rel=loss_tol)
    assert losses[1] < losses[0]  # the adapters learn
    for name, grad in expected_grads.items():
        assert ((grads[name] - grad).norm() / grad.norm()).item() < grad_tol, name
