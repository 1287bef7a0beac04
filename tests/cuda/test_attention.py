"""The forward's device kernels: the fused LM head (log-probabilities of the targets without the batch's full
logits) against plain logits + cross-entropy, and SDPA's backends (math, flash, memory-efficient) on packed
rows, against the same documents run one at a time."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from shardforge.models import build_preset
from shardforge.models.common.attention import doc_layout
from shardforge.models.common.config import DecoderConfig
from shardforge.models.head import TargetLogprobs
from shardforge.models.llama.model import Decoder

VOCAB = 1000


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


def _flat(grads: dict[str, torch.Tensor]) -> torch.Tensor:
    """All gradients as one vector, in name order (a relative error over the whole model's update)."""
    return torch.cat([grads[name].float().flatten() for name in sorted(grads)])


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_fused_head_equals_logits_and_cross_entropy(device, precision):
    """Reference: the same model's full logits [b, s, vocab] and `F.cross_entropy` summed over the scored
    positions, in the same precision on the same device (tests/unit/test_head.py's checks on the model's
    loss path). fp32: the same products in another order, loss within 1e-5 and each parameter's gradient
    within 1e-4 relative (measured on CPU: 0 and 3e-7). bf16 autocast: both take bf16 matmuls and an fp32
    softmax; the fused head makes the weight's gradient in its forward, chunk by chunk, from bf16
    products, so the sums round differently: loss within 1e-3, each gradient within 1e-2 relative
    (test_head's bf16 bound; measured on CPU: 1e-7 and 2.5e-3)."""
    model = build_preset("tiny-qwen3", vocab_size=VOCAB, seed=3, device=device)
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, VOCAB, (2, 40), generator=g).to(device)
    scored = (torch.rand(2, 40, generator=g) < 0.6).to(device)
    targets = ids.roll(-1, 1)[scored]
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16")
    with autocast:
        fused = -model(ids, output_mask=scored, head=TargetLogprobs(targets, summed=True)).sum()
    fused.backward()
    fused_grads = _grads(model)
    with autocast:
        logits = model(ids, output_mask=scored)
        plain = F.cross_entropy(logits.float(), targets, reduction="sum")
    plain.backward()
    plain_grads = _grads(model)
    loss_tol, grad_tol = (1e-5, 1e-4) if precision == "fp32" else (1e-3, 1e-2)
    assert fused.item() == pytest.approx(plain.item(), rel=loss_tol)
    assert fused_grads.keys() == plain_grads.keys() and "lm_head.weight" in fused_grads
    for name, grad in plain_grads.items():
        assert _rel(fused_grads[name], grad) < grad_tol, name


BACKENDS = {"math": SDPBackend.MATH, "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}  # fmt: skip
DOCS = (9, 13, 6)  # three documents packed in one row of 32 (4 padding positions at the end)


def _model(device: torch.device, kv_heads: int) -> Decoder:
    cfg = DecoderConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=176, num_layers=2, num_heads=4,
                        num_kv_heads=kv_heads, head_dim=16)  # fmt: skip
    model = Decoder(cfg)
    model.init_weights(std=0.1, seed=5)
    return model.to(device)


def _kernel_missing(backend: SDPBackend, device: torch.device, dtype: torch.dtype) -> bool:
    """The backend has no kernel on the CPU (the memory-efficient one). On CUDA every backend must run
    (an H100/H200 has all three): a missing one fails the test instead of skipping it."""
    if device.type == "cuda":
        return False
    q = torch.randn(1, 2, 8, 16, device=device, dtype=dtype)
    try:
        with sdpa_kernel(backend):
            F.scaled_dot_product_attention(q, q, q, is_causal=True)
    except RuntimeError:
        return True
    return False


def _inputs(device: torch.device, seed: int):
    """Three documents (DOCS) and their packed row (then 4 padding positions), positions restarting per
    document, document ids (-1: padding), and a fixed random weighting of the logits (the loss)."""
    g = torch.Generator().manual_seed(seed)
    docs = [torch.randint(1, VOCAB, (1, n), generator=g).to(device) for n in DOCS]
    ids = torch.cat([*docs, torch.zeros(1, 4, dtype=torch.long, device=device)], dim=1)
    pos = torch.cat([torch.arange(n) for n in DOCS] + [torch.zeros(4, dtype=torch.long)])[None].to(device)
    doc_ids = torch.cat([torch.full((n,), i) for i, n in enumerate(DOCS)] + [torch.full((4,), -1)])
    weights = torch.randn(ids.shape[1], VOCAB, generator=g).to(device)
    return docs, ids, pos, doc_ids[None].to(device), weights


def _packed(model: Decoder, path: str, seed: int) -> tuple[torch.Tensor, dict]:
    """The packed row's logits at the documents' positions, and the parameters' gradients of the weighted
    sum over them: through the block-diagonal boolean mask (`mask`) or the per-document layout (`layout`:
    documents gathered into a batch, plain causal attention)."""
    _, ids, pos, doc_ids, weights = _inputs(model.embed_tokens.weight.device, seed)
    n = sum(DOCS)
    if path == "mask":
        kwargs = {"doc_ids": doc_ids}
    else:
        kwargs = {"doc_layout": doc_layout([list(DOCS)], ids.shape[1]).to(ids.device)}
    packed = model(ids, position_ids=pos, **kwargs)[0, :n]
    (packed.float() * weights[:n]).sum().backward()
    return packed.detach(), _grads(model)


def _separate(model: Decoder, seed: int) -> tuple[torch.Tensor, dict]:
    """The same, each document run alone (plain causal attention), gradients summed over them."""
    docs, _, _, _, weights = _inputs(model.embed_tokens.weight.device, seed)
    outs, start = [], 0
    for doc in docs:
        out = model(doc)[0]
        (out.float() * weights[start : start + doc.shape[1]]).sum().backward()
        outs.append(out.detach())
        start += doc.shape[1]
    return torch.cat(outs), _grads(model)


def test_packed_documents_do_not_attend_across_each_other(device):
    """Reference: each document run alone (plain causal attention) on the same device in fp32, with
    whatever backend torch picks. A packed row, through the block-diagonal mask and through the
    per-document layout, gives each document's own logits and the same summed gradients: within 1e-4 (the
    same scores summed in another order; on CUDA the masked row and the documents alone may also run on
    different kernels, memory-efficient and math; measured on CPU: under 1e-6), where attention across a
    document boundary is off by 0.9 (measured)."""
    model = _model(device, kv_heads=2)
    separate, separate_grads = _separate(model, seed=6)
    for path in ("mask", "layout"):
        packed, packed_grads = _packed(model, path, seed=6)
        torch.testing.assert_close(packed, separate, rtol=1e-4, atol=1e-5)
        for name, grad in separate_grads.items():
            assert _rel(packed_grads[name], grad) < 1e-4, (path, name)


@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("path", ["mask", "layout"])
@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_sdpa_backends_agree_on_packed_rows(device, backend, path, kv_heads):
    """Each SDPA backend forced (`torch.nn.attention.sdpa_kernel`) on a packed row in bf16 (flash takes
    no fp32 on CUDA), and the documents alone on the same backend. Reference: the documents alone, the
    same weights in fp32, on the math backend (the exact softmax). Tolerance: the bf16 weights and
    activations through 2 layers move the logits and the whole gradient by 1.0e-2 to 1.5e-2 relative
    (measured on CPU, math and flash alike; the rounding of the weights dominates, which no kernel
    changes), so 3e-2; attention across the documents' boundaries is off by 0.9 (measured). The backends
    then equal each other within twice that bound, each being within it of one reference.

    What a device genuinely lacks is skipped, naming it: the memory-efficient kernel on the CPU (torch has
    none there); on CUDA, flash with a mask (the flash kernel takes none: torch picks memory-efficient for
    the mask path) and memory-efficient with grouped-query K/V without a mask (torch's kernel takes none:
    shardforge's `sdpa` repeats K/V only where a mask rules flash out, and the dispatcher picks flash)."""
    if _kernel_missing(BACKENDS[backend], device, torch.bfloat16):
        pytest.skip(f"the {backend} SDPA backend has no kernel on {device.type}")
    if device.type == "cuda" and backend == "flash" and path == "mask":
        pytest.skip("CUDA's flash SDPA kernel takes no attention mask (the mask path runs memory-efficient)")
    # CUDA's memory-efficient kernel takes no grouped-query K/V without a mask (shardforge's `sdpa` repeats
    # K/V only where a mask rules flash out; unmasked, torch's dispatcher picks flash): the documents alone
    # and the layout path are unmasked
    takes_unmasked = not (device.type == "cuda" and backend == "efficient" and kv_heads < 4)
    if not takes_unmasked and path == "layout":
        pytest.skip("CUDA's memory-efficient SDPA kernel takes no grouped-query K/V without a mask")
    model = _model(device, kv_heads)
    with sdpa_kernel(SDPBackend.MATH):
        reference, reference_grads = _separate(model, seed=7)
    model = model.to(torch.bfloat16)
    with sdpa_kernel(BACKENDS[backend]):
        packed, packed_grads = _packed(model, path, seed=7)
        separate, separate_grads = _separate(model, seed=7) if takes_unmasked else (None, {})
    assert packed.dtype == torch.bfloat16
    assert _rel(packed, reference) < 3e-2
    assert _rel(_flat(packed_grads), _flat(reference_grads)) < 3e-2
    if takes_unmasked:  # the documents alone on this backend, too
        assert _rel(separate, reference) < 3e-2
        assert _rel(_flat(separate_grads), _flat(reference_grads)) < 3e-2
