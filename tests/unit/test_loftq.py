"""LoftQ (`shardforge loftq`, LLaMA-Factory's scripts/loftq_init.py) against peft's own `loftq_init`, run on
this CPU (peft sends the weight to CUDA; its source is run with that one device swapped for the CPU): the
base's quantized weights and the adapter equal peft's, and the folder trains as QLoRA from that adapter."""

from __future__ import annotations

import inspect
import json

import pytest
import torch
from peft import LoftQConfig, LoraConfig, get_peft_model
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from shardforge.adapters.loftq import loftq_folder
from shardforge.config import load_config
from shardforge.errors import ModelError
from shardforge.train.trainer import Trainer
from tests.conftest import alpaca_records, tiny_chat_model, tiny_config, write_jsonl


@pytest.fixture
def peft_on_cpu(monkeypatch):
    """peft 0.21's `loftq_init` with its compute device the CPU (it hard-codes CUDA or XPU)."""
    import peft.tuners.lora.layer as layer
    import peft.utils.loftq_utils as utils

    source = inspect.getsource(utils.loftq_init)
    line = 'compute_device = "xpu" if is_xpu_available() else "cuda"'
    assert line in source
    namespace = dict(vars(utils))
    exec(source.replace(line, 'compute_device = "cpu"'), namespace)
    monkeypatch.setattr(layer, "loftq_init", namespace["loftq_init"])


@pytest.mark.slow
def test_the_base_and_adapter_equal_peft_s_loftq(tmp_path, peft_on_cpu):
    base = tiny_chat_model(tmp_path / "base", context=128)
    ours = loftq_folder(base, tmp_path / "loftq", rank=4, alpha=4, targets=("q_proj", "v_proj"), iters=2)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    loftq = LoftQConfig(loftq_bits=4, loftq_iter=2)
    config = LoraConfig(r=4, lora_alpha=4, target_modules=["q_proj", "v_proj"], init_lora_weights="loftq",
                        loftq_config=loftq)  # fmt: skip
    theirs = get_peft_model(model, config)
    adapter = load_file(ours / "loftq_init" / "adapter_model.safetensors")
    state = {k.replace(".default", ""): v for k, v in theirs.state_dict().items()}
    for key, value in adapter.items():
        torch.testing.assert_close(value, state[key], rtol=1e-5, atol=1e-6, msg=key)
    weights = load_file(ours / "model.safetensors")
    for key, value in weights.items():
        peft_key = "base_model.model." + key.replace(".weight", ".base_layer.weight")
        expected = state.get(peft_key, state.get("base_model.model." + key))
        torch.testing.assert_close(value, expected, rtol=1e-5, atol=1e-6, msg=key)
    assert len(adapter) == 2 * 2 * 2  # 2 layers, q and v, A and B
    assert json.loads((ours / "loftq_init" / "adapter_config.json").read_text())["r"] == 4


@pytest.mark.slow
def test_the_loftq_folder_trains_as_qlora_from_its_adapter(tmp_path):
    base = tiny_chat_model(tmp_path / "base", context=128)
    folder = loftq_folder(base, tmp_path / "loftq", rank=4, alpha=4, iters=1)
    ids = torch.tensor([[5, 17, 42, 99, 3, 8]])
    full = AutoModelForCausalLM.from_pretrained(base).eval()(ids).logits
    plain = AutoModelForCausalLM.from_pretrained(folder).eval()(ids).logits  # Q alone
    data = write_jsonl(tmp_path / "d.jsonl", alpaca_records(8))
    cfg = tiny_config(tmp_path, data, train={"steps": 2})
    cfg["model"] = {"path": str(folder), "adapter": str(folder / "loftq_init"), "quantize": "nf4"}
    lora = {"rank": 4, "alpha": 4.0, "targets": ["q_proj", "v_proj"]}
    cfg["method"] = {"finetuning": "lora", "lora": lora}
    trainer = Trainer(load_config(None, base=cfg))
    result = trainer.train()
    assert len(result.history) == 2
    from peft import PeftModel

    started = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(folder), folder / "loftq_init")
    loftq = started.eval()(ids).logits  # Q + B A: nearer the full-precision model than Q alone
    assert (loftq - full).abs().mean() < (plain - full).abs().mean()


def test_bad_loftq_requests_are_refused_by_name(tmp_path):
    base = tiny_chat_model(tmp_path / "base", context=64)
    with pytest.raises(ModelError, match="no linear of its decoder layers is named qkv"):
        loftq_folder(base, tmp_path / "x", targets=("qkv",))
    with pytest.raises(ModelError, match="a folder of its own"):
        loftq_folder(base, base)


def test_the_loftq_command_writes_both_and_says_how_to_train_them(tmp_path, capsys):
    from shardforge.cli import main

    base = tiny_chat_model(tmp_path / "base", context=64)
    argv = ["loftq", str(base), "--to", str(tmp_path / "q"), "--rank", "4", "--iter", "1"]
    assert main(argv) == 0
    said = capsys.readouterr().out
    assert "model.quantize=nf4" in said and "method.lora.alpha=8" in said
    assert json.loads((tmp_path / "q" / "loftq_init" / "adapter_config.json").read_text())["lora_alpha"] == 8
    assert main(["loftq", str(base), "--to", str(tmp_path / "r"), "--targets", "nope"]) == 2
    assert "no linear of its decoder layers is named nope" in capsys.readouterr().err
