"""What the engine loads: a LoRA run's final adapter (by the run, by the adapter folder, or as --adapter on
its base) gives peft's merged logits; a checkpoint of the run (any layout) the same weights; a full run's
final folder transformers' logits; bad sources are clear errors."""

from __future__ import annotations

import shutil

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM

from shardforge.config import load_config
from shardforge.errors import ModelError
from shardforge.infer.load import load_for_inference, unpad_vocab
from shardforge.parallel.tensor_parallel import pad_vocab
from shardforge.train.trainer import train
from tests.conftest import alpaca_records, tiny_config, write_jsonl
from tests.dist._training import tiny_model_folder

IDS = torch.randint(0, 1000, (2, 10), generator=torch.Generator().manual_seed(0))


def _run(tmp_path, name: str, method: dict, model: dict):
    data = write_jsonl(tmp_path / f"{name}.jsonl", alpaca_records(16, seed=3))
    cfg = tiny_config(
        tmp_path / name, data, method=method, train={"steps": 2, "lr": 1e-2}, checkpoint={"every": 2}
    )
    cfg["model"] = model
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    train(load_config(path))
    return tmp_path / name / "run"


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("load")
    model = tiny_model_folder(tmp / "base", 1024, seed=4, num_layers=2, num_kv_heads=2)
    lora = {"finetuning": "lora", "lora": {"rank": 4, "alpha": 8.0, "targets": "all"}}
    return model["path"], _run(tmp, "lora", lora, model), _run(tmp, "full", {"finetuning": "full"}, model)


def test_a_lora_run_loads_merged_as_peft_merges_it(runs, tmp_path):
    from peft import PeftModel

    base, lora_run, _ = runs
    reference = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), lora_run / "final")
    expected = reference.merge_and_unload().eval()(IDS).logits.detach()
    for source, adapter in ((lora_run, None), (lora_run / "final", None), (base, lora_run / "final")):
        loaded = load_for_inference(source, adapter)
        torch.testing.assert_close(_logits(loaded.model), expected, rtol=1e-4, atol=1e-4)
        assert not any(p.requires_grad for p in loaded.model.parameters())
    untrained = AutoModelForCausalLM.from_pretrained(base).eval()(IDS).logits.detach()
    assert (untrained - expected).abs().max() > 1e-3  # the adapter trained
    # Its checkpoint (adapters only, over the base) holds the same weights as the final adapter.
    no_final = tmp_path / "run"
    shutil.copytree(lora_run, no_final)
    shutil.rmtree(no_final / "final")
    torch.testing.assert_close(_logits(load_for_inference(no_final).model), expected, rtol=1e-4, atol=1e-4)


def test_a_full_run_and_its_checkpoint(runs, tmp_path):
    _, _, full_run = runs
    expected = AutoModelForCausalLM.from_pretrained(full_run / "final").eval()(IDS).logits.detach()
    loaded = load_for_inference(full_run)
    torch.testing.assert_close(_logits(loaded.model), expected, rtol=1e-5, atol=1e-5)
    assert loaded.tokenizer is not None and loaded.defaults is not None
    checkpoint = next((full_run / "checkpoints").glob("step-*"))
    torch.testing.assert_close(_logits(load_for_inference(checkpoint).model), expected, rtol=1e-5, atol=1e-5)
    assert load_for_inference(full_run, dtype="bfloat16").model.embed_tokens.weight.dtype == torch.bfloat16


def test_bad_sources_are_clear_errors(runs, tmp_path):
    _, lora_run, _ = runs
    with pytest.raises(ModelError, match="no such model folder"):
        load_for_inference(tmp_path / "missing")
    moved = tmp_path / "adapter"
    shutil.copytree(lora_run / "final", moved)
    text = (moved / "adapter_config.json").read_text()
    (moved / "adapter_config.json").write_text(text.replace(str(runs[0]), "/nowhere/base"))
    with pytest.raises(ModelError, match="not a local folder"):
        load_for_inference(moved)
    with pytest.raises(ModelError, match="dtype"):
        load_for_inference(lora_run, dtype="int3")


def test_a_tp_runs_padded_vocabulary_is_dropped(runs):
    """A TP checkpoint holds the embedding and head padded to a multiple of tp: inference drops the rows."""
    _, _, full_run = runs
    model = load_for_inference(full_run).model
    expected = _logits(model)
    pad_vocab(model, 1030)
    assert model.embed_tokens.weight.shape[0] == 1030
    unpad_vocab(model, 1024)
    assert model.lm_head.weight.shape[0] == 1024
    torch.testing.assert_close(_logits(model), expected, rtol=0, atol=0)
