"""`shardforge convert`: LLaMA-Factory training YAMLs, written here in LF's documented form (its
examples/train_lora/llama3_lora_sft.yaml, train_full with a DeepSpeed ZeRO-3 file, a DPO and a QLoRA KTO run),
read as shardforge configs that the schema accepts; unknown keys are listed, not dropped."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

from shardforge.config import load_config
from shardforge.config.lf_convert import convert_lf
from shardforge.errors import ConfigError
from tests.conftest import REPO

LORA_SFT = """
### model
model_name_or_path: meta-llama/Meta-Llama-3-8B-Instruct
trust_remote_code: true

### method
stage: sft
do_train: true
finetuning_type: lora
lora_rank: 8
lora_target: all

### dataset
dataset: identity,alpaca_en_demo
template: llama3
cutoff_len: 2048
max_samples: 1000
overwrite_cache: true
preprocessing_num_workers: 16
dataloader_num_workers: 4

### output
output_dir: saves/llama3-8b/lora/sft
logging_steps: 10
save_steps: 500
plot_loss: true
overwrite_output_dir: true
save_only_model: false
report_to: none

### train
per_device_train_batch_size: 1
gradient_accumulation_steps: 8
learning_rate: 1.0e-4
num_train_epochs: 3.0
lr_scheduler_type: cosine
warmup_ratio: 0.1
bf16: true
ddp_timeout: 180000000
resume_from_checkpoint: null
some_future_key: 3
"""


def test_lora_sft_reads_as_the_same_run():
    out = convert_lf(yaml.safe_load(LORA_SFT))
    cfg = load_config(None, base=out.config)
    assert cfg.model.path == "meta-llama/Meta-Llama-3-8B-Instruct"
    assert (cfg.method.stage, cfg.method.finetuning) == ("sft", "lora")
    assert (cfg.method.lora.rank, cfg.method.lora.alpha, cfg.method.lora.targets) == (8, 16.0, "all")
    assert [(d.name, d.dataset_info, d.max_samples) for d in cfg.data.train] == [
        ("identity", "data/dataset_info.json", 1000), ("alpaca_en_demo", "data/dataset_info.json", 1000)
    ]  # fmt: skip
    assert (cfg.data.max_length, cfg.data.packing, cfg.data.template, cfg.data.workers) == (
        2048,
        False,
        "auto",
        16,
    )
    t = cfg.train
    assert (t.micro_batch, t.grad_accum, t.lr, t.epochs, t.steps) == (1, 8, 1e-4, 3.0, None)
    assert (t.schedule, t.warmup_ratio, t.precision, t.log_every) == ("cosine", 0.1, "bf16", 10)
    assert cfg.checkpoint.every == 500 and cfg.output_dir == "saves/llama3-8b/lora/sft"
    assert cfg.log.report_to == [] and cfg.parallel.timeout_minutes == 3000000
    assert out.unknown == ["some_future_key"]
    assert any(n.startswith("template: llama3 -> data.template: auto") for n in out.notes)
    assert any(n.startswith("do_train: nothing to set") for n in out.notes)


def test_full_sft_with_deepspeed_zero3_and_offload(tmp_path):
    ds = {
        "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}},
        "bf16": {"enabled": "auto"},
    }
    (tmp_path / "ds_z3_offload_config.json").write_text(json.dumps(ds))
    lf = {"model_name_or_path": "/models/qwen", "stage": "sft", "finetuning_type": "full",
          "dataset": "alpaca_en_demo", "deepspeed": "ds_z3_offload_config.json", "max_steps": 100,
          "num_train_epochs": 3.0}  # fmt: skip
    cfg = load_config(None, base=convert_lf(lf, tmp_path).config)
    assert (cfg.parallel.zero_stage, cfg.parallel.offload) == (3, "optimizer")
    assert (cfg.train.steps, cfg.train.epochs) == (100, None)  # max_steps wins, as in HF Trainer
    # a DeepSpeed file that is not here: LF's bundled names give the stage
    named = convert_lf({**lf, "deepspeed": "examples/deepspeed/ds_z2_config.json"}, tmp_path)
    assert named.config["parallel"] == {"zero_stage": 2}


def test_dpo_and_qlora_kto():
    dpo = {"model_name_or_path": "m", "stage": "dpo", "finetuning_type": "lora", "lora_rank": 16,
           "lora_alpha": 32, "lora_target": "q_proj,v_proj", "pref_beta": 0.2, "pref_loss": "sigmoid",
           "dataset": "dpo_en_demo", "dataset_dir": "/data/lf"}  # fmt: skip
    cfg = load_config(None, base=convert_lf(dpo).config)
    assert (cfg.method.stage, cfg.method.pref.beta, cfg.method.pref.loss) == ("dpo", 0.2, "sigmoid")
    assert cfg.method.lora.targets == ["q_proj", "v_proj"] and cfg.method.lora.alpha == 32
    assert cfg.data.train[0].dataset_info == "/data/lf/dataset_info.json"
    kto = {"model_name_or_path": "m", "stage": "kto", "finetuning_type": "lora", "quantization_bit": 4,
           "kto_chosen_weight": 1.5, "dataset": "kto_en_demo"}  # fmt: skip
    cfg = load_config(None, base=convert_lf(kto).config)
    assert (cfg.model.quantize, cfg.method.kto.desirable_weight) == ("nf4", 1.5)
    with pytest.raises(ConfigError, match="quantization_bit: 8"):
        convert_lf({**kto, "quantization_bit": 8})
    with pytest.raises(ConfigError, match="stage: 'grpo' is not one of"):
        convert_lf({**kto, "stage": "grpo"})


def test_report_to_names_the_trackers_and_lists_the_rest():
    lf = {"model_name_or_path": "m", "stage": "sft", "dataset": "d", "run_name": "exp-7"}
    out = convert_lf({**lf, "report_to": "wandb,mlflow,comet_ml"})
    cfg = load_config(None, base=out.config)
    assert (cfg.log.report_to, cfg.log.run_name) == (["wandb", "mlflow"], "exp-7")
    assert out.unknown == ["report_to: comet_ml (log.report_to offers tensorboard, mlflow, wandb)"]
    everything = load_config(None, base=convert_lf({**lf, "report_to": "all"}).config)
    assert everything.log.report_to == ["tensorboard", "mlflow", "wandb"]


def test_the_command_prints_a_config_that_trains_as_written(tmp_path):
    lf = tmp_path / "lf.yaml"
    lf.write_text(LORA_SFT)
    proc = subprocess.run(
        [sys.executable, "-m", "shardforge", "convert", str(lf), "--to", str(tmp_path / "ours.yaml")],
        capture_output=True, text=True, cwd=REPO, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "unknown LLaMA-Factory key 'some_future_key'" in proc.stdout
    text = (tmp_path / "ours.yaml").read_text()
    assert "# unknown LLaMA-Factory key, not converted: some_future_key" in text
    assert load_config(tmp_path / "ours.yaml").method.lora.rank == 8
