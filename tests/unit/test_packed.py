"""Inference weights prepacked for oneDNN and the element-wise work on the fused CPU kernels
(infer/packed.py: `inference_layout`): the same linear map, and the engine's greedy tokens unchanged."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shardforge.infer.engine import Engine
from shardforge.infer.engine_types import EngineConfig
from shardforge.infer.fused_ops import FusedCpuOps
from shardforge.infer.packed import PackedLinear, PackedLinears, inference_layout, packed_while
from shardforge.infer.sampling import SamplingParams
from shardforge.models import load_model
from shardforge.models.common.elementwise import EAGER, UsesElementwise
from tests.unit.test_generate import FAMILIES, _hf_generate, _hf_model, _prompts

BF16_PACKS = torch.ops.mkldnn._is_mkldnn_bf16_supported()  # AVX-512 BW/VL/DQ: not on an AVX2-only host


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)], ids=["fp32", "bf16"])
@pytest.mark.parametrize("bias", [False, True])
def test_a_packed_linear_is_the_same_map(dtype, tol, bias):
    if dtype == torch.bfloat16 and not BF16_PACKS:
        pytest.skip("this CPU's oneDNN has no bf16 reorder (AVX2 only): can_pack keeps torch's linears there")
    torch.manual_seed(0)
    linear = nn.Linear(96, 200, bias=bias).to(dtype)
    packed = PackedLinear(linear)
    for shape in ((1, 96), (7, 96), (2, 5, 96), (1, 300, 96)):
        x = torch.randn(shape, dtype=dtype)
        want, got = linear(x).float(), packed(x).float()
        assert got.shape == want.shape
        assert (got - want).abs().max() <= tol * want.abs().max(), shape


@pytest.mark.parametrize("bias", [(False, False), (True, False), (True, True)], ids=["none", "some", "all"])
def test_fused_linears_are_each_ones_map(bias):
    """q, k and v (or gate and up) packed as one: each output is its own linear's, biases or not."""
    torch.manual_seed(0)
    linears = [nn.Linear(96, n, bias=bias[i % 2]) for i, n in enumerate((64, 32, 32))]
    fused = PackedLinears(*linears)
    x = torch.randn(2, 5, 96)
    outs = fused(x)
    assert [o.shape for o in outs] == [(2, 5, 64), (2, 5, 32), (2, 5, 32)]
    for linear, out in zip(linears, outs, strict=True):
        assert torch.allclose(out, linear(x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_engine_generates_transformers_tokens_packed(tmp_path, family):
    """Every family the engine serves: laid out for inference (q/k/v and gate/up fused where the module
    declares them, norms, rotary and SiLU * up on the fused kernels), its greedy tokens are still
    transformers' own."""
    hf, folder = _hf_model(tmp_path, family)
    model = load_model(folder)
    assert inference_layout(model)
    assert not any(type(m) is nn.Linear for m in model.modules())
    if model.native_names:
        for block in model.blocks():
            assert isinstance(block.attn.qkv, PackedLinears) and block.attn.q_proj is None
            assert isinstance(block.attn.ops, FusedCpuOps) and isinstance(block.input_norm.ops, FusedCpuOps)
    prompts = _prompts()
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    packed = [c[0].tokens for c in Engine(model, config=EngineConfig(block_size=4)).generate(prompts, params)]
    assert packed == _hf_generate(hf, prompts, 12)


def test_packed_while_gives_the_trained_model_back(tmp_path):
    """An RL rollout packs the policy and puts it back: the same modules, parameters and outputs after."""
    _, folder = _hf_model(tmp_path, "qwen2")  # q/k/v biases, a tied head
    model = load_model(folder)
    before = {name: (p, p.clone()) for name, p in model.named_parameters()}
    modules = dict(model.named_modules())
    ids = torch.tensor([[5, 9, 2, 7]])
    with torch.no_grad():
        want = model(ids)
        with packed_while(model):
            packed = model(ids)
            assert model.layers[0].attn.q_proj is None
            assert isinstance(model.layers[0].mlp.ops, FusedCpuOps)
        got = model(ids)
    assert all(
        m.ops is EAGER and "ops" not in vars(m) for m in model.modules() if isinstance(m, UsesElementwise)
    )
    assert dict(model.named_modules()).keys() == modules.keys()
    assert all(modules[name] is m for name, m in model.named_modules())
    params = dict(model.named_parameters())
    assert params.keys() == before.keys()
    assert all(params[n] is p and torch.equal(p, copy) for n, (p, copy) in before.items())
    assert torch.equal(got, want)
    assert torch.allclose(packed, want, atol=1e-5, rtol=1e-4)


def test_a_bf16_model_packs_only_where_onednn_can_and_runs_either_way():
    """On an AVX2-only CPU oneDNN refuses bf16 weights: the layout leaves torch's linears, and the forward
    is the unpacked one's."""
    from shardforge.infer.packed import can_pack, pack_linears
    from shardforge.models.presets import build_preset

    torch.manual_seed(0)
    model = build_preset("tiny-llama", 128).to(torch.bfloat16).eval()
    ids = torch.randint(0, 100, (1, 12))
    with torch.no_grad():
        want = model(ids)
        assert can_pack(model) == BF16_PACKS and can_pack(model.float().to(torch.bfloat16)) == BF16_PACKS
        undo = pack_linears(model)
        assert bool(undo) == BF16_PACKS
        got = model(ids)
    assert torch.allclose(got.float(), want.float(), atol=5e-2, rtol=5e-2)
