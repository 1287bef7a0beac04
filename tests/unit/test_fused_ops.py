"""The fused CPU kernels of a block's element-wise work (infer/elementwise.cpp through infer/fused_ops.py)
against torch's eager ops (models/common/elementwise.py), over the shapes and layouts a forward hands them,
and the eager ops wherever the kernels do not apply."""

from __future__ import annotations

import pytest
import torch

from shardforge.infer.cpu_kernels import cpu_kernels
from shardforge.infer.fused_ops import FusedCpuOps, fuse_elementwise
from shardforge.infer.packed import restore
from shardforge.models.common.elementwise import EAGER
from shardforge.models.llama.rope import inv_frequencies, rope_cos_sin
from shardforge.models.presets import build_preset
from tests.conftest import unavailable


@pytest.fixture(autouse=True)
def _kernels():
    if cpu_kernels() is None:
        unavailable("no C++ compiler to build the kernels")


TOL = 2e-6  # of the output's scale: fp32, a different order of the norm's sum, a polynomial exp


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype
    assert (got - want).abs().max() <= TOL * want.abs().max().clamp(min=1.0), (got - want).abs().max()


@pytest.fixture(scope="module")
def ops() -> FusedCpuOps:
    return FusedCpuOps(cpu_kernels())


@pytest.mark.parametrize("width", [1, 7, 64, 576, 1000])
@pytest.mark.parametrize("rows", [(1, 1), (1, 5), (3, 17), (1, 700)])
def test_rms_norm(ops, width, rows):
    torch.manual_seed(width)
    x, weight = torch.randn(*rows, width) * 3, torch.randn(width)
    with torch.no_grad():
        _close(ops.rms_norm(x, weight, 1e-6), EAGER.rms_norm(x, weight, 1e-6))
        # Qwen3's q/k norm: a [b, s, heads, d] view of the projection's output
        qkv = torch.randn(*rows, 4 * width)
        view = qkv[..., width : 3 * width].view(*rows, 2, width)
        _close(ops.rms_norm(view, weight, 1e-6), EAGER.rms_norm(view, weight, 1e-6))


@pytest.mark.parametrize("head_dim", [8, 64, 80, 128])
@pytest.mark.parametrize("batch, seq, heads, kv_heads", [(1, 1, 9, 3), (1, 64, 4, 4), (2, 9, 6, 2)])
def test_rope_of_q_and_k(ops, head_dim, batch, seq, heads, kv_heads):
    """q and k as the attention hands them: [b, heads, s, d] transposed views of one projection's output."""
    torch.manual_seed(head_dim + seq)
    qkv = torch.randn(batch, seq, (heads + 2 * kv_heads) * head_dim) * 2
    q, k, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
    q, k = (t.view(batch, seq, -1, head_dim).transpose(1, 2) for t in (q, k))
    positions = torch.randint(0, 30_000, (batch, seq))
    cos, sin = rope_cos_sin(positions, inv_frequencies(head_dim, 10_000.0, None), torch.float32)
    with torch.no_grad():
        got, want = ops.rope(q, k, cos, sin), EAGER.rope(q, k, cos, sin)
        for g, w in zip(got, want, strict=True):
            _close(g, w)
        shared = cos[:1].expand(batch, -1, -1, -1), sin[:1].expand(batch, -1, -1, -1)  # one row's positions
        for g, w in zip(ops.rope(q, k, *shared), EAGER.rope(q, k, *shared), strict=True):
            _close(g, w)


@pytest.mark.parametrize("width", [1, 15, 16, 1536, 1537])
@pytest.mark.parametrize("rows", [1, 3, 64])
def test_silu_mul_of_a_gate_up_split(ops, width, rows):
    torch.manual_seed(width + rows)
    gate_up = torch.randn(1, rows, 2 * width) * 6
    gate_up[0, 0, :4] = torch.tensor([-200.0, -88.5, 90.0, 300.0])[: min(4, 2 * width)]  # past exp's range
    gate, up = gate_up.split([width, width], -1)
    with torch.no_grad():
        _close(ops.silu_mul(gate, up), EAGER.silu_mul(gate, up))


def test_calls_outside_the_kernels_shapes_run_eager(ops):
    """What a block never hands them but another caller might: eager's answer, not an error or a crash (a
    per-head cos once read head 0 only; an empty one crashed the process)."""
    torch.manual_seed(0)
    q, k = torch.randn(1, 4, 5, 8), torch.randn(1, 2, 5, 8)
    x, gate = torch.randn(3, 16), torch.randn(2, 0)
    cases = [
        ("rope", (q, q, torch.randn(1, 4, 5, 8), torch.randn(1, 4, 5, 8))),  # cos per head
        ("rope", (q, k, torch.randn(1, 1, 1, 8), torch.randn(1, 1, 1, 8))),  # one position over five
        ("rope", (q[..., :7], k[..., :7], torch.randn(1, 1, 5, 7), torch.randn(1, 1, 5, 7))),  # odd head_dim
        ("rms_norm", (x, torch.randn(16, dtype=torch.bfloat16), 1e-6)),
        ("silu_mul", (gate, gate)),
        ("silu_mul", (x, torch.randn(1, 16))),  # up broadcast
    ]  # fmt: skip
    with torch.no_grad():
        for name, args in cases:
            got, want = getattr(ops, name)(*args), getattr(EAGER, name)(*args)
            for g, w in zip(*(o if isinstance(o, tuple) else (o,) for o in (got, want)), strict=True):
                assert torch.equal(g, w), name
        empty = torch.randn(1, 0, 5, 8)
        with pytest.raises(RuntimeError, match="must match the size"):  # torch's own error, not a crash
            ops.rope(q, q, empty, empty)


def test_what_the_kernels_do_not_cover_runs_eager(ops):
    """A forward that records gradients gets torch's gradients; a bf16 stream (autocast) torch's values."""
    torch.manual_seed(0)
    x, weight = torch.randn(4, 64, requires_grad=True), torch.randn(64, requires_grad=True)
    ops.rms_norm(x, weight, 1e-6).square().sum().backward()
    want = [t.grad.clone() for t in (x, weight)]
    x.grad = weight.grad = None
    EAGER.rms_norm(x, weight, 1e-6).square().sum().backward()
    assert all(torch.equal(t.grad, w) for t, w in zip((x, weight), want, strict=True))
    low = torch.randn(3, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(ops.silu_mul(low, low), EAGER.silu_mul(low, low))


@pytest.mark.parametrize("preset", ["tiny-qwen2", "tiny-qwen3", "tiny-qwen2-moe"])
def test_a_model_forward_is_the_same_fused_and_its_ops_come_back(preset):
    """Biases, q/k norms, a mixture of experts (its dense layer fused, its experts eager)."""
    model = build_preset(preset, 256).eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 11))
    with torch.no_grad():
        want = model(ids)
        undo = fuse_elementwise(model)
        assert undo and all(isinstance(module.ops, FusedCpuOps) for module, _, _ in undo)
        got = model(ids)
    restore(undo)
    assert all(
        module.ops is EAGER and "ops" not in vars(module) for module, _, _ in undo
    )  # the class's again
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    assert fuse_elementwise(model.to(torch.bfloat16)) == []  # fp32 models only
