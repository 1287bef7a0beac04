"""`shardforge convert`: LLaMA-Factory training YAMLs, written here in LF's documented form (its
examples/train_lora/llama3_lora_sft.yaml, train_full with a DeepSpeed ZeRO-3 file, a DPO and a QLoRA KTO run),
read as shardforge configs that the schema accepts; keys without a counterpart refuse the file (listed), bad
values are one-line errors. tests/lf/ checks the same against LLaMA-Factory's own parser."""

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
    assert out.unsupported == ["some_future_key: no counterpart in shardforge"]
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
    assert (t.min_lr_ratio, t.betas, t.seed) == (0.0, (0.9, 0.999), 42)  # LF's (transformers') values
    assert cfg.checkpoint.every == 500 and cfg.output_dir == "saves/llama3-8b/lora/sft"
    assert cfg.checkpoint.resume == "none"  # overwrite_output_dir: true starts afresh
    assert cfg.log.report_to == [] and cfg.parallel.timeout_minutes == 3000000
    assert any(n.startswith("template: llama3 -> data.template: auto") for n in out.notes)
    assert any(n.startswith("do_train: nothing to set") for n in out.notes)


def test_full_sft_with_deepspeed_zero3_and_offload(tmp_path, monkeypatch):
    ds = {
        "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}},
        "bf16": {"enabled": "auto"},
    }
    (tmp_path / "ds_z3_offload_config.json").write_text(json.dumps(ds))
    lf = {"model_name_or_path": "/models/qwen", "stage": "sft", "finetuning_type": "full",
          "dataset": "alpaca_en_demo", "deepspeed": "ds_z3_offload_config.json", "max_steps": 100,
          "num_train_epochs": 3.0}  # fmt: skip
    monkeypatch.chdir(tmp_path)  # LF reads it from the working directory
    cfg = load_config(None, base=convert_lf(lf).config)
    assert (cfg.parallel.zero_stage, cfg.parallel.offload) == (3, "optimizer")
    assert (cfg.train.steps, cfg.train.epochs) == (100, None)  # max_steps wins, as in HF Trainer
    inline = convert_lf({**lf, "deepspeed": {"zero_optimization": {"stage": 1}}})  # read, not its digits
    assert inline.config["parallel"]["zero_stage"] == 1 and load_config(None, base=inline.config)
    with pytest.raises(ConfigError, match=r"ds_z2_config\.json is not a file"):  # no stage from a name
        convert_lf({**lf, "deepspeed": "examples/deepspeed/ds_z2_config.json"})


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
    assert convert_lf({**kto, "quantization_bit": 8}).unsupported[0].startswith("quantization_bit: 8")
    kto_beta = load_config(None, base=convert_lf({**kto, "pref_beta": 0.3}).config)
    assert kto_beta.method.kto.beta == 0.3  # LF's pref_beta is KTO's beta under stage kto
    with pytest.raises(ConfigError, match="stage: 'grpo' is not one of"):
        convert_lf({**kto, "stage": "grpo"})


def test_thinking_switch_and_tool_format():
    lf = {
        "model_name_or_path": "m",
        "stage": "sft",
        "dataset": "glaive_toolcall_en_demo",
        "template": "qwen3",
    }
    assert load_config(None, base=convert_lf(lf).config).data.enable_thinking is True  # LF's default
    off = load_config(None, base=convert_lf({**lf, "enable_thinking": False}).config)
    assert off.data.enable_thinking is False
    assert convert_lf({**lf, "tool_format": "glm4"}).unsupported == [
        "tool_format: a tool format other than the model's chat template's own"
    ]


def test_report_to_names_the_trackers_and_lists_the_rest():
    lf = {"model_name_or_path": "m", "stage": "sft", "dataset": "d", "run_name": "exp-7"}
    out = convert_lf({**lf, "report_to": "wandb,mlflow,comet_ml"})
    cfg = load_config(None, base=out.config)
    assert (cfg.log.report_to, cfg.log.run_name) == (["wandb", "mlflow"], "exp-7")
    assert out.unsupported == ["report_to: comet_ml (log.report_to offers tensorboard, mlflow, wandb)"]
    everything = load_config(None, base=convert_lf({**lf, "report_to": "all"}).config)
    assert everything.log.report_to == ["tensorboard", "mlflow", "wandb"]


def test_the_command_prints_a_config_that_trains_as_written(tmp_path):
    lf = tmp_path / "lf.yaml"
    lf.write_text(LORA_SFT)
    run = [sys.executable, "-m", "shardforge", "convert", str(lf), "--to", str(tmp_path / "ours.yaml")]
    refused = subprocess.run(run, capture_output=True, text=True, cwd=REPO, timeout=120)
    assert refused.returncode == 2 and "some_future_key: no counterpart" in refused.stdout, refused.stdout
    assert not (tmp_path / "ours.yaml").exists()
    allow = [*run, "--allow-unsupported"]
    proc = subprocess.run(allow, capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr
    text = (tmp_path / "ours.yaml").read_text()
    assert "# UNSUPPORTED (--allow-unsupported), not honoured: some_future_key" in text
    assert load_config(tmp_path / "ours.yaml").method.lora.rank == 8


def test_bad_values_are_one_line_errors_naming_the_key():
    base = {"model_name_or_path": "m", "dataset": "d"}
    bad = {"lora_rank": "eight", "learning_rate": "fast", "bf16": "maybe", "val_size": 2.5}
    for key, value in bad.items():
        with pytest.raises(ConfigError, match=rf"^{key}: "):
            convert_lf({**base, key: value})


def test_a_pre_quantized_checkpoint_is_refused_by_name(tmp_path):
    from transformers import LlamaConfig

    from shardforge import load_model
    from shardforge.errors import ModelError

    awq = {"quant_method": "awq", "bits": 4}
    cfg = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, quantization_config=awq)  # fmt: skip
    cfg.save_pretrained(tmp_path)
    with pytest.raises(ModelError, match=r"a pre-quantized checkpoint \(quantization_config: awq\)"):
        load_model(tmp_path)


def test_lf_truncation_keeps_examples_a_long_prompt_would_drop():
    """data.truncation: lf shortens the prompt and the replies as LF's pairwise and supervised processors
    do (one prompt for both replies), where `right` loses every reply token and drops the pair."""
    import numpy as np

    from shardforge.data.encode import encode_all
    from shardforge.data.examples import Encoder
    from shardforge.data.formats import Record
    from shardforge.data.truncate import cut_turns

    class Pair(Encoder):
        def __call__(self, record):
            prompt, chosen, rejected = [1] * 30, [2] * 5, [3] * 8
            chosen_flags, rejected_flags = [False] * 30 + [True] * 5, [False] * 30 + [True] * 8
            return [(prompt + chosen, chosen_flags), (prompt + rejected, rejected_flags)]

    pair = Pair()

    records = [Record(f"pairs.jsonl:{i}", None, "x") for i in range(3)]
    with pytest.raises(Exception, match="no example has a trainable token"):
        encode_all(records, pair, 16, "right", "training data", group_size=2)
    store, stats = encode_all(records, pair, 16, "lf", "training data", group_size=2, shared_prompt=True)
    assert stats.truncated == 3 and not stats.dropped_no_target
    # infer_seqlen(30, 8, 16): both cut in proportion, 3 reply tokens and 13 of the prompt
    assert store.lengths.tolist() == [16, 16] * 3 and store.num_targets.tolist() == [3, 3] * 3
    # a conversation turn by turn: the first turn whole, the second's prompt and reply shortened
    ids = np.arange(20, dtype=np.uint32)
    trained = np.array([False] * 4 + [True] * 4 + [False] * 6 + [True] * 6)
    cut_ids, cut_trained = cut_turns((ids, trained), 12)
    assert cut_ids.tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 14, 15]
    assert cut_trained.tolist() == [False] * 4 + [True] * 4 + [False] * 2 + [True] * 2


def test_pretraining_blocks_concatenate_cut_and_start_with_bos():
    import numpy as np

    from shardforge.data.truncate import pretraining_blocks

    stream = np.arange(1, 12, dtype=np.uint32)  # 11 tokens: 2 blocks of 4, 3 left over and dropped
    assert [b.tolist() for b in pretraining_blocks(stream, 4, None)] == [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert [b.tolist() for b in pretraining_blocks(stream, 4, 0)] == [[0, 2, 3, 4], [0, 6, 7, 8]]
    assert stream.tolist() == list(range(1, 12))  # the stream itself is left as it was
    pt = convert_lf({"model_name_or_path": "m", "dataset": "c4_demo", "stage": "pt"}).config["data"]
    assert pt["pt_blocks"] and pt["packing"] and pt["max_length"] == 2048  # LF's default for pt
