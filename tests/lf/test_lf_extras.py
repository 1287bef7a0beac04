"""LLaMA-Factory's own examples/extras YAMLs for its training menu (the DFT loss, LoRA+, PiSSA, OFT and
QOFT, LLaMA Pro, the optimizers) convert with nothing refused and train on the demo model (the README's demo
preset, saved as an HF folder) with LF's demo data, read through LF's dataset_info.json as LF reads it."""

from __future__ import annotations

import json

import pytest
import torch
import yaml

from shardforge.config import load_config
from shardforge.config.lf_convert import convert_lf
from shardforge.config.schema import ModelSection
from shardforge.models import save_model
from shardforge.models.build import load_tokenizer
from shardforge.models.expand import expand_blocks
from shardforge.models.llama.model import Decoder
from shardforge.models.presets import preset_config
from shardforge.train.trainer import Trainer
from tests.conftest import TOKENIZER
from tests.lf.reference_env import reference

pytestmark = pytest.mark.slow

# LF's example -> what it needs on the demo model besides the short run (its LLaMA Pro example trains the 8
# blocks added to Llama-3-8B; the demo's 4 layers get 4)
EXTRAS = {
    "dft/qwen2_full_sft.yaml": [],
    "loraplus/llama3_lora_sft.yaml": [],
    "pissa/llama3_lora_sft.yaml": [],
    "oft/llama3_oft_sft.yaml": [],
    "qoft/llama3_oft_sft_bnb_npu.yaml": [],
    "llama_pro/llama3_freeze_sft.yaml": ["method.freeze.trainable_layers=4"],
    "galore/llama3_full_sft.yaml": [],
    "apollo/llama3_full_sft.yaml": [],
    "badam/llama3_full_sft.yaml": ["train.optimizer.badam.switch_interval=1"],  # a block switch in 2 steps
    "adam_mini/qwen2_full_sft.yaml": [],
    "muon/qwen2_full_sft.yaml": [],
}


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """The demo preset as an HF folder with the bundled tokenizer, and its LLaMA Pro expansion."""
    folder = tmp_path_factory.mktemp("demo")
    tokenizer = load_tokenizer(ModelSection(tokenizer=str(TOKENIZER), preset="demo"))
    model = Decoder(preset_config("demo", vocab_size=len(tokenizer)))
    model.init_weights(seed=0)
    base = save_model(model, folder / "base", tokenizer=tokenizer)
    return {"base": base, "pro": expand_blocks(base, folder / "pro", 4)}


@pytest.mark.parametrize("example", sorted(EXTRAS))
def test_lf_s_extras_convert_and_train_on_the_demo_model(demo, tmp_path, monkeypatch, example):
    ref = reference()
    monkeypatch.chdir(ref.src)  # LF reads dataset_dir (data/) from where it runs
    converted = convert_lf(yaml.safe_load((ref.src / "examples" / "extras" / example).read_text()))
    assert not converted.unsupported, converted.unsupported
    model = demo["pro"] if "llama_pro" in example else demo["base"]
    overrides = [
        f"model.path={model}", f"output_dir={tmp_path / 'run'}", "data.max_length=128", "train.steps=2",
        "train.epochs=null", "train.micro_batch=2", "train.grad_accum=1", "train.log_every=1",
        "checkpoint.every=null", "log.plot=false", f"data.cache_dir={tmp_path / 'cache'}",
        "hardware.peak_flops=1e11", *EXTRAS[example],
    ]  # fmt: skip
    config = load_config(None, overrides, base=converted.config)
    result = Trainer(config).train()
    assert len(result.history) == 2 and all(torch.isfinite(torch.tensor(r["loss"])) for r in result.history)
    final = tmp_path / "run" / "final"
    adapter = final / "adapter_config.json"
    if config.method.adapters:  # LoRA / OFT runs hand back a PEFT folder
        assert json.loads(adapter.read_text())["peft_type"] == config.method.finetuning.upper()
    else:
        assert (final / "config.json").is_file()


def test_lf_s_prediction_yaml_becomes_shardforge_eval_and_runs(demo, tmp_path):
    """extras/nlg_eval (do_predict with predict_with_generate): the equivalent `shardforge eval` command,
    run as printed on the demo model (its adapter left out, the run shortened), writes LF's two files."""
    import shlex
    import subprocess
    import sys

    ref = reference()
    source = ref.src / "examples" / "extras" / "nlg_eval" / "llama3_lora_predict.yaml"
    converted = convert_lf(yaml.safe_load(source.read_text()))
    assert converted.command is not None and not converted.unsupported
    words = shlex.split(converted.command)
    assert words[:2] == ["shardforge", "eval"] and "--temperature" in words  # LF samples by default
    args = dict(zip(words[3::2], words[4::2], strict=True))
    assert args["--data"] == "identity,alpaca_en_demo" and args["--max-samples"] == "50"
    args.pop("--adapter")  # a LoRA run of the 8B model in LF's example
    args |= {"--max-samples": "3", "--max-new-tokens": "8", "--out": str(tmp_path / "predict")}
    command = [
        sys.executable,
        "-m",
        "shardforge",
        "eval",
        str(demo["base"]),
        *(x for kv in args.items() for x in kv),
    ]
    proc = subprocess.run(command, capture_output=True, text=True, cwd=ref.src, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = (tmp_path / "predict" / "generated_predictions.jsonl").read_text().splitlines()
    assert len(lines) == 6 and set(json.loads(lines[0])) >= {"prompt", "predict", "label"}
    metrics = json.loads((tmp_path / "predict" / "predict_results.json").read_text())
    assert {"predict_bleu-4", "predict_rouge-1", "predict_rouge-2", "predict_rouge-l"} <= set(metrics)
