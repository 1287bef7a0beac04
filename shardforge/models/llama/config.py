"""Shape and variant knobs of the Llama decoder family (Llama 2/3.x, Mistral, Qwen2/2.5, Qwen3)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class DecoderConfig:
    """Everything the model code needs; HF config.json is translated into this by the family's adapter."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # {"rope_type": "llama3"|"linear", ...} as in HF
    max_position: int = 2048
    tie_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2: bias on q/k/v only
    o_bias: bool = False  # Llama attention_bias=True puts a bias on o_proj too
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    sliding_window: int | None = None
    layer_types: list[str] | None = None  # per layer "full_attention" | "sliding_attention"
    family: str = "llama"
    hf_config: dict = field(default_factory=dict)  # the original config.json, written back on export

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}"
            )

    def is_sliding(self, layer: int) -> bool:
        if self.sliding_window is None:
            return False
        if self.layer_types is None:
            return True
        return self.layer_types[layer] == "sliding_attention"

    def num_params(self, include_embedding: bool = True) -> int:
        """Parameter count from shapes (for FLOP and memory estimates)."""
        h, i, d = self.hidden_size, self.intermediate_size, self.head_dim
        q, kv = self.num_heads * d, self.num_kv_heads * d
        attn = h * (q + 2 * kv) + q * h
        attn += (q + 2 * kv) * self.qkv_bias + h * self.o_bias + 2 * d * self.qk_norm
        mlp = 3 * h * i + (2 * i + h) * self.mlp_bias
        per_layer = attn + mlp + 2 * h
        emb = self.vocab_size * h
        total = self.num_layers * per_layer + h + (emb if include_embedding else 0)
        if not self.tie_embeddings or not include_embedding:
            total += emb
        return total

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6 x matmul params plus causal attention (Megatron/PaLM accounting)."""
        dense = 6 * self.num_params(include_embedding=False)
        attn = 6 * self.num_layers * self.num_heads * self.head_dim * seq_len  # 12*L*h*d*s/2 (causal)
        return float(dense + attn)
