"""The paged-attention inference engine on the device: its greedy tokens under continuous batching equal
transformers' `generate` on the same device (tests/unit/test_engine.py's check, with the device as a
parameter)."""

from __future__ import annotations

import pytest
import torch

from shardforge.infer.engine import Engine
from shardforge.infer.engine_types import EngineConfig
from shardforge.infer.sampling import SamplingParams
from shardforge.models import load_model
from tests.unit.test_engine import _run
from tests.unit.test_generate import _hf_model, _prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)


def _hf_greedy(hf, prompt: list[int], n: int, device: torch.device) -> list[int]:
    hf.generation_config.eos_token_id = None  # no row may stop early
    ids = torch.tensor([prompt], device=device)
    out = hf.generate(ids, max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_greedy_tokens_match_transformers_on_the_device(tmp_path, device, family):
    """Reference: transformers' greedy `generate` of each prompt alone (eager attention), fp32, on the same
    device. Exact token equality: the weights are drawn large (tests/unit/test_generate.py's `_hf_model`),
    so the logits are peaked and fp32 rounding (TF32 stays off, torch's default for matmuls) cannot flip
    an argmax. Six prompts, blocks of 4 and 16 tokens a step, half the requests joining after 3 steps:
    chunked prefill mixed with decodes; mistral's sliding window (16) is crossed."""
    hf, folder = _hf_model(tmp_path, family)
    hf = hf.to(device)
    prompts = _prompts((5, 11, 20, 3, 17, 9), seed=2)
    expected = [_hf_greedy(hf, p, 20, device) for p in prompts]
    model = load_model(folder, device=device)
    engine = Engine(model, config=EngineConfig(block_size=4, max_step_tokens=16, num_blocks=64))
    got = _run(engine, {f"r{i}": (p, GREEDY) for i, p in enumerate(prompts)}, join_after=3)
    assert [got[f"r{i}"] for i in range(len(prompts))] == expected
    assert len({tuple(row) for row in expected}) == len(prompts)  # the rows really differ
    assert engine.blocks.in_use == 0 and not engine.requests
    assert engine.executor.runner.kv.keys[0].device.type == device.type  # the paged pool is on the device
