"""HF parity contract: our logits equal transformers' on the same checkpoint, both ways round."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from shardforge import load_model, save_model
from shardforge.errors import ModelError
from shardforge.models.common.costs import param_counts

BASE = dict(
    vocab_size=97, hidden_size=48, intermediate_size=80, num_hidden_layers=2, max_position_embeddings=256
)
CASES = {
    # GQA, llama3 rope scaling, odd head count (3 kv heads for 6 heads)
    "llama3_gqa": (
        "llama",
        dict(
            num_attention_heads=6,
            num_key_value_heads=3,
            head_dim=8,
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        ),
    ),
    "llama2_mha_bias": (
        "llama",
        dict(num_attention_heads=4, num_key_value_heads=4, attention_bias=True, mlp_bias=True),
    ),
    "llama_tied_linear": (
        "llama",
        dict(
            num_attention_heads=4,
            num_key_value_heads=1,
            tie_word_embeddings=True,
            rope_scaling={"rope_type": "linear", "factor": 2.0},
        ),
    ),
    "mistral": ("mistral", dict(num_attention_heads=4, num_key_value_heads=2, sliding_window=7)),
    "qwen2": ("qwen2", dict(num_attention_heads=6, num_key_value_heads=2, tie_word_embeddings=True)),
    "qwen3": ("qwen3", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16)),
}


def _hf_model(tmp_path, case: str):
    model_type, extra = CASES[case]
    cfg = AutoConfig.for_model(model_type, **BASE, **extra)
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    with torch.no_grad():  # non-trivial biases and norms so a missed weight shows
        for name, p in hf.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.normal_(0.0, 0.5 if "bias" in name else 0.2).add_(1.0 if "norm" in name else 0.0)
    folder = tmp_path / f"hf_{case}"
    hf.save_pretrained(folder)
    return hf, folder


def _ids(vocab: int, batch: int = 2, seq: int = 24) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers(tmp_path, case):
    hf, folder = _hf_model(tmp_path, case)
    ours = load_model(folder).eval()
    ids = _ids(hf.config.vocab_size)
    with torch.no_grad():
        expected = hf(ids).logits
        got = ours(ids)
    assert got.shape == expected.shape
    assert (got - expected).abs().max().item() < 1e-4


@pytest.mark.parametrize("case", sorted(CASES))
def test_export_reloads_in_transformers(tmp_path, case):
    hf, folder = _hf_model(tmp_path, case)
    ours = load_model(folder).eval()
    out = save_model(ours, tmp_path / "export")
    back = AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    assert type(back).__name__ == type(hf).__name__
    ids = _ids(hf.config.vocab_size)
    with torch.no_grad():
        assert (back(ids).logits - ours(ids)).abs().max().item() < 1e-4


def test_sharded_save_and_load_roundtrip(tmp_path):
    _, folder = _hf_model(tmp_path, "llama3_gqa")
    ours = load_model(folder).eval()
    out = save_model(ours, tmp_path / "sharded", max_shard_bytes=20_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    again = load_model(out).eval()
    hf_back = AutoModelForCausalLM.from_pretrained(out).eval()
    ids = _ids(97)
    with torch.no_grad():
        assert torch.equal(again(ids), ours(ids))
        assert (hf_back(ids).logits - ours(ids)).abs().max().item() < 1e-4


def test_packed_positions_match_separate_documents(tmp_path):
    """Two documents packed in one row with restarting positions give each document's own logits."""
    _, folder = _hf_model(tmp_path, "qwen3")
    ours = load_model(folder).eval()
    a, b = _ids(97, 1, 9), _ids(97, 1, 13)
    packed = torch.cat([a, b], dim=1)
    pos = torch.cat([torch.arange(9), torch.arange(13)])[None]
    doc = torch.cat([torch.zeros(9), torch.ones(13)]).long()[None]
    with torch.no_grad():
        got = ours(packed, position_ids=pos, doc_ids=doc)
        torch.testing.assert_close(got[:, :9], ours(a), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got[:, 9:], ours(b), rtol=1e-5, atol=1e-5)


def test_unsupported_model_is_clear_error(tmp_path):
    """A model_type neither we nor transformers implement; one only transformers does, on `native`."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "no_such_lm", "architectures": ["NoLM"]}))
    with pytest.raises(ModelError, match=r"supported: .*llama.*transformers has no causal LM"):
        load_model(tmp_path)
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]})
    )
    with pytest.raises(ModelError, match=r"model_type='gpt2' has no native family .*model\.backend: auto"):
        load_model(tmp_path, backend="native")


def test_missing_weights_is_clear_error(tmp_path):
    _, folder = _hf_model(tmp_path, "llama2_mha_bias")
    from safetensors.torch import load_file, save_file

    weights = load_file(folder / "model.safetensors")
    weights.pop("model.layers.1.mlp.up_proj.weight")
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelError, match=r"missing 1 weight.*layers\.1\.mlp\.up_proj"):
        load_model(folder)


def test_low_precision_cast_keeps_fp32_rope(tmp_path):
    _, folder = _hf_model(tmp_path, "llama3_gqa")
    ours = load_model(folder, dtype=torch.bfloat16)
    assert ours.inv_freq.dtype == torch.float32
    assert next(ours.parameters()).dtype == torch.bfloat16
    torch.testing.assert_close(ours.inv_freq, load_model(folder).inv_freq)


@pytest.mark.parametrize("case", sorted(CASES))
def test_parameter_count_formula(tmp_path, case):
    """The cost model's parameter count (used for FLOPs and the planner) equals the real parameter count."""
    _, folder = _hf_model(tmp_path, case)
    ours = load_model(folder)
    assert param_counts(ours.config).total == sum(p.numel() for p in ours.parameters())


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-mistral", "tiny-qwen2", "tiny-qwen3"])
def test_preset_export_matches_transformers(tmp_path, preset):
    """A model built from a preset (no HF config to start from) exports a config transformers runs
    identically, including the sliding window (sequence longer than tiny-mistral's window of 32)."""
    from shardforge.models import build_preset

    ours = build_preset(preset, vocab_size=97, seed=2).eval()
    back = AutoModelForCausalLM.from_pretrained(save_model(ours, tmp_path / preset)).eval()
    ids = _ids(97, 2, 48)
    with torch.no_grad():
        assert (back(ids).logits - ours(ids)).abs().max().item() < 1e-4


def test_corrupt_or_incomplete_weights_are_clear_errors(tmp_path):
    _, folder = _hf_model(tmp_path, "qwen2")
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[:1000])
    with pytest.raises(ModelError, match=r"cannot read safetensors weights.*truncated"):
        load_model(folder)
    (folder / "model.safetensors").unlink()
    index = {"metadata": {}, "weight_map": {"model.norm.weight": "model-00001-of-00002.safetensors"}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ModelError, match="lists weight files that are missing: model-00001-of-00002"):
        load_model(folder)
