"""Shape and variant knobs of the Llama decoder family (Llama 2/3.x, Mistral, Qwen2/2.5, Qwen3)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

from shardforge.models.common.images import ImagePrompt


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
    # 0: the LM head over the vocabulary; n > 0: a score head of n outputs on the final hidden state (HF's
    # ...ForSequenceClassification `score`; a reward model has 1), never tied to the embedding
    num_labels: int = 0
    # Mixture of experts (Mixtral, Qwen2-MoE, Qwen3-MoE; models/moe.py); 0 experts: dense everywhere
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0  # each expert's width (intermediate_size stays the dense layers')
    norm_topk_prob: bool = True  # the top-k weights renormalized to sum to 1
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's sigmoid-gated shared expert (0: none)
    dense_layers: list[int] = field(default_factory=list)  # layers that keep the dense MLP
    router_aux_loss_coef: float = 0.0  # the checkpoint's own default for method.moe.aux_loss_coef
    hf_config: dict = field(default_factory=dict)  # the original config.json, written back on export

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}"
            )

    def is_moe(self, layer: int) -> bool:
        return self.num_experts > 0 and layer not in self.dense_layers

    @property
    def moe_layers(self) -> list[int]:
        return [i for i in range(self.num_layers) if self.is_moe(i)]

    def kv_heads_per_rank(self, tp: int) -> float:
        """The kv heads one tensor-parallel rank holds: its share, or one (replicated) above them."""
        return self.num_kv_heads / tp if tp <= self.num_kv_heads else 1.0

    takes_images: ClassVar[bool] = False  # a vision-language family's (images in its forward and data)
    packs_images: ClassVar[bool] = True  # packed rows (several documents) may hold images

    def planned_patches(self, max_pixels: int) -> int:
        """The tower's patches of one image of `max_pixels` (the planner's image per row); 0: a text
        model."""
        return 0

    @property
    def deepstack_layers(self) -> int:
        """Decoder layers after whose outputs the family adds image features (Qwen3-VL's deepstack): they
        need the whole stream (not a sequence-parallel shard), on the first pipeline stage."""
        return 0

    def part_of(self, name: str) -> str:
        """Which part of the model a parameter (our name) is in: "tower" (a vision encoder), "projector"
        (what maps its features into the decoder), "language" (the decoder), "newline" (LLaVA-NeXT's
        image_newline, which no method.vision switch freezes), or "unused" (held, as the checkpoint has it,
        but no output depends on it: never trained)."""
        return "language"

    def image_prompt(self, tokenizer: Any) -> ImagePrompt | None:
        """What an image becomes in a prompt (a vision-language family's); None: a text model."""
        return None

    def with_score_head(self, num_labels: int) -> DecoderConfig:
        return replace(self, num_labels=num_labels, tie_embeddings=False)

    def is_sliding(self, layer: int) -> bool:
        if self.sliding_window is None:
            return False
        if self.layer_types is None:
            return True
        return self.layer_types[layer] == "sliding_attention"
