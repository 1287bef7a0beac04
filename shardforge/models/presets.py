"""Named model shapes for building from scratch (tests, demo, benchmarks). The vocabulary comes from the
tokenizer."""

from __future__ import annotations

import difflib

import torch
from torch import nn

from shardforge.errors import ModelError
from shardforge.models.common.config import DecoderConfig
from shardforge.models.io import Prune, build_empty
from shardforge.models.spec import spec_for


def _shape(
    family: str, hidden: int, ffn: int, layers: int, heads: int, kv_heads: int, head_dim: int, **extra
) -> dict:
    return dict(
        family=family,
        hidden_size=hidden,
        intermediate_size=ffn,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        **extra,
    )


def _moe(
    experts: int, k: int, width: int, renormalize: bool = True, shared: int = 0, dense: list | None = None
) -> dict:
    return dict(
        num_experts=experts,
        experts_per_token=k,
        moe_intermediate_size=width,
        norm_topk_prob=renormalize,
        shared_expert_intermediate_size=shared,
        dense_layers=dense or [],
        router_aux_loss_coef=0.001,
    )


_PRESETS: dict[str, dict] = {
    "tiny-llama": _shape("llama", 64, 176, 2, 4, 2, 16),
    "tiny-mistral": _shape("mistral", 64, 176, 2, 4, 2, 16, sliding_window=32),
    "tiny-qwen2": _shape("qwen2", 64, 176, 2, 4, 2, 16, qkv_bias=True, tie_embeddings=True),
    "tiny-qwen3": _shape("qwen3", 64, 176, 2, 4, 2, 16, qk_norm=True),
    # Mixtures of experts (8 experts, 2 per token): Mixtral, Qwen2-MoE (shared expert, first layer dense),
    # Qwen3-MoE (q/k norms)
    "tiny-mixtral": _shape("mixtral", 64, 96, 2, 4, 2, 16, **_moe(8, 2, 48)),
    "tiny-qwen2-moe": _shape(
        "qwen2_moe", 64, 176, 2, 4, 2, 16, qkv_bias=True, **_moe(8, 2, 48, False, 64, [0])
    ),
    "tiny-qwen3-moe": _shape("qwen3_moe", 64, 176, 2, 4, 2, 16, qk_norm=True, **_moe(8, 2, 48)),
    # The README demo: ~3M parameters with the bundled 1k vocabulary; trains visibly in minutes on 2 cores.
    "demo": _shape("llama", 256, 688, 4, 8, 4, 32, tie_embeddings=True),
    # Benchmark sizes; parameter counts are with the bundled 1k-token vocabulary.
    "llama-10m": _shape("llama", 384, 1024, 6, 6, 3, 64),
    "llama-25m": _shape("llama", 512, 1408, 8, 8, 4, 64),
    # GPU benchmark size (~300M with the 1k vocabulary): big enough to load an H200's tensor cores.
    "llama-300m": _shape("llama", 1024, 2816, 24, 16, 8, 64),
    # Llama-3.2-1B's shape (~0.98B parameters with the 1k vocabulary; its own 128k vocabulary adds 0.26B): the
    # GPU check's training size (benchmarks/gpu_check.py), bf16 throughput and MFU on one H200.
    "llama-1b": _shape("llama", 2048, 8192, 16, 32, 8, 64),
}


def preset_names() -> list[str]:
    return sorted(_PRESETS)


def preset_config(name: str, vocab_size: int, max_position: int = 4096) -> DecoderConfig:
    if name not in _PRESETS:
        close = difflib.get_close_matches(name, _PRESETS, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ModelError(f"unknown model preset {name!r}{hint} (available: {', '.join(preset_names())})")
    return DecoderConfig(vocab_size=vocab_size, max_position=max_position, **_PRESETS[name])


def build_preset(
    name: str,
    vocab_size: int,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    device: str | torch.device = "cpu",
    prune: Prune | None = None,
    num_labels: int = 0,
) -> nn.Module:
    """A freshly initialized model of a preset shape (deterministic for a given seed, whatever the device and
    whatever `prune` keeps of it: a pipeline stage gets the weights the whole model would have). Initialized
    in fp32 on the CPU (the same random streams everywhere), then cast and moved. `num_labels` > 0: with a
    score head of that many outputs instead of the LM head."""
    cfg = preset_config(name, vocab_size)
    cfg = cfg.with_score_head(num_labels) if num_labels else cfg
    model = build_empty(spec_for(cfg.family), cfg, "cpu", prune)
    model.init_weights(seed=seed)
    return model.to(dtype).to(device)
