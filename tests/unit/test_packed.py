"""Inference weights prepacked for oneDNN (infer/packed.py): the same linear map, and the engine's greedy
tokens unchanged."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shardforge.infer.engine import Engine, EngineConfig
from shardforge.infer.packed import PackedLinear, pack_linears
from shardforge.infer.sampling import SamplingParams
from shardforge.models import load_model
from tests.unit.test_generate import FAMILIES, _hf_generate, _hf_model, _prompts


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)], ids=["fp32", "bf16"])
@pytest.mark.parametrize("bias", [False, True])
def test_a_packed_linear_is_the_same_map(dtype, tol, bias):
    torch.manual_seed(0)
    linear = nn.Linear(96, 200, bias=bias).to(dtype)
    packed = PackedLinear(linear)
    for shape in ((1, 96), (7, 96), (2, 5, 96), (1, 300, 96)):
        x = torch.randn(shape, dtype=dtype)
        want, got = linear(x).float(), packed(x).float()
        assert got.shape == want.shape
        assert (got - want).abs().max() <= tol * want.abs().max(), shape


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_engine_generates_transformers_tokens_packed(tmp_path, family):
    """Every family the engine serves: packed, its greedy tokens are still transformers' own."""
    hf, folder = _hf_model(tmp_path, family)
    model = load_model(folder)
    linears = sum(type(m) is nn.Linear for m in model.modules())
    assert len(pack_linears(model)) == linears > 0
    assert not any(type(m) is nn.Linear for m in model.modules())
    prompts = _prompts()
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    packed = [c[0].tokens for c in Engine(model, config=EngineConfig(block_size=4)).generate(prompts, params)]
    assert packed == _hf_generate(hf, prompts, 12)
