"""The fused LM head (models/head.py): the log-probabilities of the targets and their gradients equal
log_softmax(h @ W.T) computed whole, for a summed token loss (the weight's gradient made in the forward) and
for per-position coefficients (recomputed in backward), with a frozen weight and without gradients; and no
tensor of the batch's positions x the vocabulary ever exists, only chunks of it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from shardforge.models import build_preset, head
from shardforge.models.head import TargetLogprobs, target_logprobs

N, HIDDEN, VOCAB = 300, 48, 1000


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    monkeypatch.setattr(head, "CHUNK_BYTES", 4 * VOCAB * 70)  # 70 rows: 5 chunks, the last one short
    monkeypatch.setattr(head, "_MIN_CHUNK", 1)


def _inputs(seed: int = 0, dtype: torch.dtype = torch.float32):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, HIDDEN, generator=g).to(dtype)
    linear = nn.Linear(HIDDEN, VOCAB, bias=False).to(dtype)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(VOCAB, HIDDEN, generator=g) * 0.2)
    return hidden, linear, torch.randint(0, VOCAB, (N,), generator=g)


def _grads(fn, hidden, linear, targets, coefficients):
    h = hidden.clone().requires_grad_()
    linear.weight.grad = None
    out = fn(linear, h, targets)
    (out * coefficients).sum().backward()
    w = linear.weight.grad.clone() if linear.weight.grad is not None else None
    return out.detach(), h.grad, w


def _reference(linear, h, targets):
    logits = F.linear(h, linear.weight).float()
    return logits.log_softmax(-1).gather(1, targets[:, None]).squeeze(1)


@pytest.mark.parametrize(("summed", "uniform"), [(True, True), (True, False), (False, True), (False, False)])
def test_log_probs_and_gradients_equal_the_whole_log_softmax(summed, uniform):
    """`summed` with one coefficient takes the forward-made weight gradient; a broken promise (different
    coefficients) is caught in backward and recomputed, exactly."""
    hidden, linear, targets = _inputs()
    coefficients = torch.full((N,), -0.37) if uniform else torch.rand(N, generator=torch.Generator())
    fused = _grads(lambda *a: target_logprobs(*a, summed=summed), hidden, linear, targets, coefficients)
    ref = _grads(_reference, hidden, linear, targets, coefficients)
    for ours, theirs in zip(fused, ref, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


def test_a_frozen_head_and_evaluation():
    hidden, linear, targets = _inputs(1)
    linear.weight.requires_grad_(False)
    coefficients = torch.rand(N)
    fused = _grads(lambda *a: target_logprobs(*a, summed=True), hidden, linear, targets, coefficients)
    ref = _grads(_reference, hidden, linear, targets, coefficients)
    assert fused[2] is None and ref[2] is None
    torch.testing.assert_close(fused[1], ref[1], rtol=1e-5, atol=1e-6)
    linear.weight.requires_grad_(True)
    with torch.no_grad():
        expected = _reference(linear, hidden, targets)
        with _Largest() as mode:  # evaluation of a trained head: no gradient work
            got = target_logprobs(linear, hidden, targets)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    assert mode.matmuls == 5  # one a chunk


def test_bf16_matches_the_whole_log_softmax_in_bf16():
    """Both sides' matmuls in bf16, their softmax in fp32: the same precision, compared at bf16's noise."""
    hidden, linear, targets = _inputs(2, torch.bfloat16)
    coefficients = torch.full((N,), -1.0)
    fused = _grads(lambda *a: target_logprobs(*a, summed=True), hidden, linear, targets, coefficients)
    ref = _grads(_reference, hidden, linear, targets, coefficients)
    torch.testing.assert_close(fused[0], ref[0], rtol=0, atol=1e-5)  # fp32 log-probs of the same logits
    for ours, theirs in zip(fused[1:], ref[1:], strict=True):
        assert ours.dtype == torch.bfloat16
        assert ((ours.float() - theirs.float()).norm() / theirs.float().norm()) < 1e-2


class _Largest(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.largest, self.matmuls = 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.matmuls += func in (torch.ops.aten.mm.default, torch.ops.aten.addmm_.default)
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_no_tensor_of_positions_by_vocabulary_exists():
    hidden, linear, targets = _inputs(3)
    h = hidden.clone().requires_grad_()
    with _Largest() as mode:
        (-target_logprobs(linear, h, targets, summed=True).sum()).backward()
    assert mode.largest == 70 * VOCAB  # one chunk of logits, never N x VOCAB
    with _Largest() as mode:
        F.cross_entropy(F.linear(hidden, linear.weight), targets)
    assert mode.largest == N * VOCAB  # what the plain head holds


def test_the_model_forward_with_targets_gives_the_log_probs_of_its_logits():
    model = build_preset("tiny-qwen3", vocab_size=VOCAB, seed=3)
    ids = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(4))
    scored = torch.rand(2, 40, generator=torch.Generator().manual_seed(5)) < 0.6
    targets = ids.roll(-1, 1)[scored]
    with torch.no_grad():
        logits = model(ids, output_mask=scored)
        fused = model(ids, output_mask=scored, head=TargetLogprobs(targets))
    expected = logits.float().log_softmax(-1).gather(1, targets[:, None]).squeeze(1)
    torch.testing.assert_close(fused, expected, rtol=1e-5, atol=1e-5)


def test_backward_can_run_twice():
    """torch's pipeline schedules run backward for the inputs, then again for the weights."""
    hidden, linear, targets = _inputs(6)
    h = hidden.clone().requires_grad_()
    loss = -target_logprobs(linear, h, targets, summed=True).sum()
    first = torch.autograd.grad(loss, [h, linear.weight], retain_graph=True)
    second = torch.autograd.grad(loss, [h, linear.weight])
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)
