"""OFT (method.finetuning: oft) against peft's: a layer's rotation, forward and merge (the Neumann series
and the exact Cayley transform, and peft's block size adjusted to a width it does not divide), 3 training
steps against peft's OFT model on the same batches, the adapter folder peft reloads, and the merged export."""

from __future__ import annotations

import pytest
import torch
from peft import OFTConfig, PeftModel, get_peft_model, inject_adapter_in_model
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from shardforge.adapters.oft import OFTLinear
from shardforge.config import load_config
from shardforge.errors import ConfigError
from tests.conftest import alpaca_records, tiny_config, write_jsonl
from tests.training_reference import ce_sum, hf_steps, train_ours

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.mark.parametrize(("width", "block", "neumann"), [(48, 16, True), (48, 16, False), (40, 16, True)])
def test_a_layer_rotates_and_merges_as_peft_s(width, block, neumann):
    torch.manual_seed(0)
    base = torch.nn.Linear(width, 24)
    ours = OFTLinear(base, block, 5 if neumann else None)
    holder = torch.nn.Module()
    holder.q_proj = torch.nn.Linear(width, 24)
    holder.q_proj.load_state_dict(base.state_dict())
    config = OFTConfig(r=0, oft_block_size=block, target_modules=["q_proj"], use_cayley_neumann=neumann)
    theirs = inject_adapter_in_model(config, holder).q_proj
    assert ours.oft_R.shape == theirs.oft_R["default"].weight.shape  # 40 wide: peft's adjusted block (20)
    with torch.no_grad():
        ours.oft_R.normal_(0, 0.05)
        theirs.oft_R["default"].weight.copy_(ours.oft_R)
    x = torch.randn(2, 3, width)
    torch.testing.assert_close(ours(x), theirs(x), rtol=1e-5, atol=1e-6)
    merged = ours.merged_weight()
    theirs.merge()
    torch.testing.assert_close(merged, theirs.base_layer.weight, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_three_steps_the_adapter_and_the_merge_equal_peft_s(tmp_path):
    oft = {"block_size": 16, "targets": TARGETS}
    trainer, batches = train_ours(tmp_path, method={"finetuning": "oft", "oft": oft})
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32)
    model = get_peft_model(base, OFTConfig(r=0, oft_block_size=16, target_modules=TARGETS))
    hf_steps(model, batches, ce_sum)
    model.save_pretrained(tmp_path / "theirs")
    ours_dir = trainer.run_dir / "final"
    ours, theirs = (load_file(d / "adapter_model.safetensors") for d in (ours_dir, tmp_path / "theirs"))
    assert ours.keys() == theirs.keys() and ours
    for key in theirs:
        torch.testing.assert_close(ours[key], theirs[key], rtol=1e-5, atol=1e-5, msg=key)
    ids = torch.tensor([[5, 17, 42, 99, 3, 8]])
    fresh = AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32)
    loaded = PeftModel.from_pretrained(fresh, ours_dir).eval()  # peft reads our folder as its own
    torch.testing.assert_close(loaded(ids).logits, model.eval()(ids).logits, rtol=1e-5, atol=1e-5)
    from shardforge.checkpoint.export import export

    _, merged, _ = export(trainer.run_dir, tmp_path / "merged", merge=True)
    plain = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()
    torch.testing.assert_close(plain(ids).logits, model(ids).logits, rtol=1e-5, atol=1e-5)


def test_oft_is_refused_where_it_cannot_run(tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", alpaca_records(4))
    cfg = tiny_config(tmp_path, data, method={"finetuning": "oft"}, parallel={"tp": 2})
    with pytest.raises(ConfigError, match=r"method.finetuning=oft with parallel.tp=2"):
        load_config(None, base=cfg)
    cfg = tiny_config(tmp_path, data, method={"finetuning": "oft", "oft": {"targets": ["qkv"]}})
    with pytest.raises(ConfigError, match=r"method.oft.targets: 'qkv'"):
        load_config(None, base=cfg)


@pytest.mark.slow
def test_oft_over_an_nf4_base_equals_peft_s_oft_over_that_base(tmp_path):
    """QOFT (LLaMA-Factory's extras/qoft with quantization_bit 4): OFT over the frozen NF4 base trains as
    peft's OFT over the same 4-bit weights, dequantized."""
    from shardforge.models.quantize import dequantized, nf4

    oft = {"block_size": 16, "targets": TARGETS}
    trainer, batches = train_ours(
        tmp_path, method={"finetuning": "oft", "oft": oft}, model={"quantize": "nf4"}
    )
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32)
    with torch.no_grad():
        for name, module in base.named_modules():
            if isinstance(module, torch.nn.Linear) and ".layers." in name:
                module.weight.copy_(dequantized(nf4(module.weight)))
    model = get_peft_model(base, OFTConfig(r=0, oft_block_size=16, target_modules=TARGETS))
    hf_steps(model, batches, ce_sum)
    model.save_pretrained(tmp_path / "theirs")
    ours, theirs = (
        load_file(d / "adapter_model.safetensors") for d in (trainer.run_dir / "final", tmp_path / "theirs")
    )
    for key in theirs:
        torch.testing.assert_close(ours[key], theirs[key], rtol=1e-5, atol=1e-5, msg=key)
