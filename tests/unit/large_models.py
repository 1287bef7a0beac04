"""Public models by shape for the planner's tests (config.json only, no weights): Llama-3-70B, Llama-3.1-405B
and Qwen3-235B-A22B, the config a planning test starts from, and H100 clusters of a given size."""

from __future__ import annotations

from shardforge.config.schema import Config
from shardforge.planner.hardware import PRESETS, Cluster

LLAMA3 = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_act": "silu",
    "vocab_size": 128256,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": False,
}
MODELS = {
    "llama3-70b": {
        **LLAMA3,
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "num_hidden_layers": 80,
    },
    "llama3.1-405b": {
        **LLAMA3,
        "hidden_size": 16384,
        "intermediate_size": 53248,
        "num_attention_heads": 128,
        "num_key_value_heads": 8,
        "num_hidden_layers": 126,
    },
    "qwen3-235b-a22b": {  # the keys transformers' Qwen3MoeConfig and models/llama/moe_adapter.py read
        "model_type": "qwen3_moe",
        "architectures": ["Qwen3MoeForCausalLM"],
        "hidden_act": "silu",
        "hidden_size": 4096,
        "intermediate_size": 12288,  # the dense MLP's (no dense layers here: decoder_sparse_step 1)
        "num_hidden_layers": 94,
        "num_attention_heads": 64,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 1536,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "router_aux_loss_coef": 0.001,
        "vocab_size": 151936,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 40960,
        "tie_word_embeddings": False,
    },
}
# Published sizes (parameters), which the shapes above must reproduce when counted tensor by tensor.
PUBLISHED = {"llama3-70b": 70.6e9, "llama3.1-405b": 405.9e9, "qwen3-235b-a22b": 235.1e9}
H100_PER_NODE = 8


def config_for(path, global_batch: int = 1024, **sections) -> Config:
    train = {"precision": "bf16", "global_batch": global_batch, "micro_batch": 1, **sections.pop("train", {})}
    return Config(
        model={"path": str(path)},
        data={"train": [{"path": "x.jsonl", "format": "alpaca"}], "max_length": 4096},
        train=train,
        **sections,
    )


def h100s(devices: int) -> Cluster:
    return Cluster(PRESETS["h100"], max(1, devices // H100_PER_NODE), min(devices, H100_PER_NODE))
