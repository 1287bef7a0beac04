"""PiSSA (method.lora.init: pissa) against peft's: the initial A and B of a layer (full SVD, and fast SVD from
the same random start), 3 training steps against peft's PiSSA model on the same batches, and the adapter we
write against peft's own conversion to a plain LoRA (`path_initial_model_for_weight_conversion`)."""

from __future__ import annotations

import json
import zlib

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model, inject_adapter_in_model
from peft.tuners.lora.layer import Linear as PeftLinear
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from shardforge.adapters.lora import LoRALinear
from shardforge.config import load_config
from shardforge.errors import ConfigError
from tests.conftest import alpaca_records, tiny_config, write_jsonl
from tests.training_reference import ce_sum, hf_steps, train_ours

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.mark.parametrize(("iters", "peft_init"), [(-1, "pissa"), (4, "pissa_niter_4")])
def test_a_layer_starts_where_peft_s_pissa_starts_it(iters, peft_init, monkeypatch):
    torch.manual_seed(0)
    base = torch.nn.Linear(24, 40, bias=False)
    ours = LoRALinear(base, 4, 8.0, 0.0, dora=False, rslora=False, pissa_iter=iters)
    ours.reset_adapter("layers.0.q_proj", seed=7)
    holder = torch.nn.Module()
    holder.q_proj = torch.nn.Linear(24, 40, bias=False)
    holder.q_proj.weight.data.copy_(base.weight)
    original = PeftLinear.pissa_init

    def seeded(self, *args):  # our fast SVD's random start: peft draws it from torch's generator
        torch.manual_seed(7 + zlib.crc32(b"layers.0.q_proj"))
        original(self, *args)

    monkeypatch.setattr(PeftLinear, "pissa_init", seeded)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], init_lora_weights=peft_init)
    theirs = inject_adapter_in_model(config, holder).q_proj
    torch.testing.assert_close(ours.lora_A, theirs.lora_A["default"].weight, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours.lora_B, theirs.lora_B["default"].weight, rtol=1e-5, atol=1e-6)
    x = torch.randn(3, 24)
    torch.testing.assert_close(ours(x), theirs(x), rtol=1e-5, atol=1e-6)  # W x = W_res x + s B0 A0 x
    torch.testing.assert_close(ours(x), base(x), rtol=1e-5, atol=1e-5)  # and a fresh adapter changes nothing


@pytest.mark.slow
def test_three_steps_and_the_adapter_equal_peft_s(tmp_path):
    lora = {"rank": 4, "alpha": 8.0, "targets": TARGETS, "init": "pissa", "pissa_iter": -1}
    trainer, batches = train_ours(tmp_path, method={"finetuning": "lora", "lora": lora})
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, init_lora_weights="pissa")
    model = get_peft_model(base, config)
    model.save_pretrained(tmp_path / "init")  # peft's conversion subtracts this start
    hf_steps(model, batches, ce_sum)
    model.save_pretrained(
        tmp_path / "theirs", path_initial_model_for_weight_conversion=str(tmp_path / "init")
    )
    ours_dir, theirs_dir = trainer.run_dir / "final", tmp_path / "theirs"
    ours, theirs = (load_file(d / "adapter_model.safetensors") for d in (ours_dir, theirs_dir))
    assert ours.keys() == theirs.keys() and ours
    for key in theirs:
        torch.testing.assert_close(ours[key], theirs[key], rtol=1e-5, atol=1e-5, msg=key)
    mine, peft_s = (json.loads((d / "adapter_config.json").read_text()) for d in (ours_dir, theirs_dir))
    assert (mine["r"], mine["lora_alpha"]) == (peft_s["r"], peft_s["lora_alpha"]) == (8, 16)
    ids = torch.tensor([[5, 17, 42, 99, 3, 8]])  # the adapter on the original base computes peft's model
    fresh = AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32)
    loaded = PeftModel.from_pretrained(fresh, ours_dir).eval()
    torch.testing.assert_close(loaded(ids).logits, model.eval()(ids).logits, rtol=1e-5, atol=1e-5)


def test_pissa_is_refused_where_it_cannot_start(tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", alpaca_records(4))
    cases = {
        "with dora": {"method": {"finetuning": "lora", "lora": {"init": "pissa", "dora": True}}},
        "with model.quantize=nf4": {"method": {"finetuning": "lora", "lora": {"init": "pissa"}},
                                    "model": {"quantize": "nf4"}},
        "with parallel.tp=2": {"method": {"finetuning": "lora", "lora": {"init": "pissa"}},
                               "parallel": {"tp": 2}},
    }  # fmt: skip
    for what, sections in cases.items():
        cfg = tiny_config(tmp_path, data, **sections)
        with pytest.raises(ConfigError, match=f"method.lora.init=pissa {what}"):
            load_config(None, base=cfg)
