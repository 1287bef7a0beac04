"""Named model shapes for building from scratch (tests, demo, benchmarks). The vocabulary comes from the
tokenizer."""

from __future__ import annotations

import difflib

import torch
from torch import nn

from shardforge.errors import ModelError
from shardforge.models.llama.config import DecoderConfig
from shardforge.models.spec import spec_by_name

_PRESETS: dict[str, dict] = {
    "tiny-llama": dict(
        family="llama",
        hidden_size=64,
        intermediate_size=176,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
    ),
    "tiny-mistral": dict(
        family="mistral",
        hidden_size=64,
        intermediate_size=176,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        sliding_window=32,
    ),
    "tiny-qwen2": dict(
        family="qwen2",
        hidden_size=64,
        intermediate_size=176,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        qkv_bias=True,
        tie_embeddings=True,
    ),
    "tiny-qwen3": dict(
        family="qwen3",
        hidden_size=64,
        intermediate_size=176,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        qk_norm=True,
    ),
    # The README demo: ~4M parameters with a 1k vocabulary, trains visibly in minutes on 2 CPU cores.
    "demo": dict(
        family="llama",
        hidden_size=256,
        intermediate_size=688,
        num_layers=4,
        num_heads=8,
        num_kv_heads=4,
        head_dim=32,
        tie_embeddings=True,
    ),
    # Benchmark sizes; parameter counts are with the bundled 1k-token vocabulary.
    "llama-10m": dict(
        family="llama",
        hidden_size=384,
        intermediate_size=1024,
        num_layers=6,
        num_heads=6,
        num_kv_heads=3,
        head_dim=64,
    ),
    "llama-25m": dict(
        family="llama",
        hidden_size=512,
        intermediate_size=1408,
        num_layers=8,
        num_heads=8,
        num_kv_heads=4,
        head_dim=64,
    ),
}


def preset_names() -> list[str]:
    return sorted(_PRESETS)


def preset_config(name: str, vocab_size: int, max_position: int = 4096) -> DecoderConfig:
    if name not in _PRESETS:
        close = difflib.get_close_matches(name, _PRESETS, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ModelError(f"unknown model preset {name!r}{hint} (available: {', '.join(preset_names())})")
    return DecoderConfig(vocab_size=vocab_size, max_position=max_position, **_PRESETS[name])


def build_preset(name: str, vocab_size: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> nn.Module:
    """A freshly initialized model of a preset shape (deterministic for a given seed)."""
    cfg = preset_config(name, vocab_size)
    model = spec_by_name(cfg.family).model_cls(cfg)
    model.init_weights(generator=torch.Generator().manual_seed(seed))
    return model.to(dtype)
