"""The generic backend (models/generic): families shardforge does not implement run with transformers' own
modules. Each family is built tiny from its transformers config in the test, saved as an HF folder, loaded by
shardforge, and checked against transformers' own forward on the same batch; training runs through the one
loop; what the backend cannot do is refused with the model_type named."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from shardforge import load_model, save_model
from shardforge.config import load_config
from shardforge.errors import ConfigError, ModelError
from shardforge.models.build import check_model_source
from shardforge.models.generic.model import HFCausalLM
from shardforge.models.spec import spec_for
from shardforge.planner.layout import check_layout
from shardforge.train.trainer import Trainer
from tests.conftest import TOKENIZER, tiny_config, write_jsonl

VOCAB = 1024  # the bundled tokenizer's
SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)  # fmt: skip
FAMILIES = {
    "gemma2": dict(head_dim=16, final_logit_softcapping=30.0, attn_logit_softcapping=50.0, sliding_window=8),
    "phi3": dict(pad_token_id=0),
    "olmo2": dict(),
    "granite": dict(logits_scaling=4.0, embedding_multiplier=2.0, residual_multiplier=0.5),
    "glm4": dict(head_dim=16, pad_token_id=0),
}


def hf_folder(root, model_type: str):
    """A random tiny model of the family, saved by transformers (weights perturbed off their init so that
    a missed norm or bias shows)."""
    cfg = AutoConfig.for_model(model_type, **SHAPE, **FAMILIES[model_type])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    folder = root / model_type
    model.save_pretrained(folder)
    return folder


def _batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (2, 12), generator=g)
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[:, :4] = False  # a prompt: not scored
    return ids, mask


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_generic_model_equals_transformers(tmp_path, model_type):
    """Log-probs of the targets (the fused head, or the family's transformed logits) and logits equal
    transformers' own forward of the same folder; the folder round-trips through save_model."""
    folder = hf_folder(tmp_path, model_type)
    ours = load_model(folder).eval()
    assert isinstance(ours, HFCausalLM) and ours.config.family == f"hf:{model_type}"
    reference = AutoModelForCausalLM.from_pretrained(folder).eval()
    ids, mask = _batch()
    scored = mask[:, 1:]  # position p is scored when token p + 1 is a target
    targets = ids[:, 1:][scored]
    output_mask = torch.cat([scored, torch.zeros_like(scored[:, :1])], dim=1)
    with torch.no_grad():
        expected_logits = reference(input_ids=ids).logits
        expected = expected_logits[:, :-1].log_softmax(-1)[scored].gather(-1, targets[:, None]).squeeze(1)
        logits = ours(ids)
        logps = ours(ids, output_mask=output_mask, targets=targets)
    torch.testing.assert_close(logits, expected_logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logps, expected, rtol=1e-5, atol=1e-5)
    again = load_model(save_model(ours, tmp_path / "saved"))
    with torch.no_grad():
        torch.testing.assert_close(again(ids), expected_logits, rtol=1e-6, atol=1e-6)


def test_backend_choice(tmp_path):
    folder = hf_folder(tmp_path, "olmo2")
    assert spec_for("llama").name == "llama"
    assert spec_for("llama", backend="hf").name == "hf"
    assert spec_for("olmo2").name == "hf"
    with pytest.raises(ModelError, match=r"model_type='olmo2' has no native family.*model\.backend: auto"):
        spec_for("olmo2", backend="native")
    with pytest.raises(ModelError, match="transformers has no causal LM"):
        spec_for("no_such_model")
    assert isinstance(load_model(folder), HFCausalLM)


def _train_config(tmp_path, folder, name: str, **sections) -> dict:
    rows = [
        {"instruction": f"Add {a} and {a + 2}.", "input": "", "output": str(2 * a + 2)} for a in range(12)
    ]
    data = write_jsonl(tmp_path / "data.jsonl", rows)
    model = {"path": str(folder), "preset": None, "tokenizer": str(TOKENIZER), **sections.pop("model", {})}
    data_section = {"packing": False, "max_length": 64, **sections.pop("data", {})}
    train = {
        "steps": 3,
        "micro_batch": 2,
        "lr": 1e-3,
        "warmup": 0,
        "log_every": 1,
        **sections.pop("train", {}),
    }
    return tiny_config(tmp_path / name, data, model=model, data=data_section, train=train, **sections)


def test_native_and_generic_backends_train_alike(tmp_path):
    """The same llama folder on both backends: the same losses over three SFT steps (a cross-check of both
    implementations)."""
    cfg = AutoConfig.for_model("llama", **SHAPE, head_dim=16)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "llama")
    runs = {}
    for backend in ("native", "hf"):
        config = _train_config(tmp_path, tmp_path / "llama", backend, model={"backend": backend})
        runs[backend] = [r["loss"] for r in Trainer(load_config(None, base=config)).train().history]
    assert runs["hf"] == pytest.approx(runs["native"], rel=1e-5)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["parallel.tp=2", "parallel.dp_shard=1"],
            r"parallel\.tp=2 is not available on the generic backend \(olmo2",
        ),
        (["parallel.pp=2", "parallel.dp_shard=1"], r"parallel\.pp=2 .*native family \(.*llama"),
        (["method.finetuning=lora"], r"method\.finetuning=lora is not available on the generic backend"),
        (["model.quantize=nf4", "method.finetuning=lora"], r"model\.quantize=nf4"),
        (["method.stage=grpo"], r"method\.stage=grpo is not available"),
    ],
)
def test_what_the_generic_backend_refuses(tmp_path, overrides, message):
    """Before any process starts (the preflight's layout check, for 2 processes), naming the model_type and
    the native families."""
    folder = hf_folder(tmp_path, "olmo2")
    cfg = load_config(None, overrides, base=_train_config(tmp_path, folder, "refused"))
    with pytest.raises(ConfigError, match=message):
        check_layout(cfg, 2, check_model_source(cfg.model))


def test_packing_is_switched_off_with_a_message(tmp_path, capsys):
    folder = hf_folder(tmp_path, "olmo2")
    config = _train_config(tmp_path, folder, "packed", data={"packing": True}, train={"steps": 1})
    trainer = Trainer(load_config(None, base=config))
    trainer.train()
    out = capsys.readouterr().out
    assert "data.packing is off: the generic backend (olmo2) has no per-document attention" in out
    assert "model: olmo2 on the generic backend (transformers' modules; no native family)" in out
    assert trainer.run.config.data.packing is False
