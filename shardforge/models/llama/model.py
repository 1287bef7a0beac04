"""The Llama decoder family in plain PyTorch. No parallel code here: layouts are applied from outside."""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import ClassVar

import torch
from torch import nn

from shardforge.errors import ModelError
from shardforge.models.common.attention import (
    AttentionContext,
    Cache,
    DocLayout,
    attention_context,
    attention_per_document,
    real_tokens,
    sdpa,
)
from shardforge.models.common.config import DecoderConfig
from shardforge.models.common.elementwise import UsesElementwise
from shardforge.models.common.images import ImageInputs
from shardforge.models.common.protocol import FusedProjections, StagedModel
from shardforge.models.head import Head, HeadInput, HeadOutput, apply_head, target_logprobs
from shardforge.models.llama.rope import inv_frequencies, rope_cos_sin
from shardforge.models.moe import SparseMoE


class RMSNorm(nn.Module, UsesElementwise):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps)


class Attention(nn.Module, FusedProjections, UsesElementwise):
    FUSED: ClassVar[dict[str, tuple[str, ...]]] = {"qkv": ("q_proj", "k_proj", "v_proj")}

    def __init__(self, cfg: DecoderConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer  # its slot in a KV cache
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=cfg.o_bias)
        self.qkv: nn.Module | None = None  # inference: q, k and v in one matmul (FusedProjections)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_eps) if cfg.qk_norm else None

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: AttentionContext, sliding: bool
    ) -> torch.Tensor:
        b, s, _ = x.shape
        # -1 instead of the head count keeps this correct when TP shards the projections by heads.
        q, k, v = self.qkv(x) if self.qkv is not None else (self.q_proj(x), self.k_proj(x), self.v_proj(x))
        q, k, v = (t.view(b, s, -1, self.head_dim) for t in (q, k, v))
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q, k = self.ops.rope(q, k, cos, sin)
        if ctx.cache is not None:
            out = ctx.cache.attend(self.layer, q, k, v, sliding)
        elif ctx.layout is not None:
            out = attention_per_document(q, k, v, ctx.layout, ctx.window if sliding else None)
        else:
            out = sdpa(q, k, v, ctx.sliding if sliding else ctx.full)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module, FusedProjections, UsesElementwise):
    FUSED: ClassVar[dict[str, tuple[str, ...]]] = {"gate_up": ("gate_proj", "up_proj")}

    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.gate_up: nn.Module | None = None  # inference: both in one matmul (FusedProjections)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x) if self.gate_up is not None else (self.gate_proj(x), self.up_proj(x))
        return self.down_proj(self.ops.silu_mul(gate, up))


MLPFactory = Callable[[DecoderConfig, int], nn.Module]  # (config, layer index) -> the block's MLP


class Block(nn.Module):
    """Pre-norm attention and MLP; `mlp` builds another MLP than the dense one (a mixture of experts)."""

    def __init__(self, cfg: DecoderConfig, layer: int, mlp: MLPFactory | None = None) -> None:
        super().__init__()
        self.sliding = cfg.is_sliding(layer)
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.attn = Attention(cfg, layer)
        self.post_attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.mlp = mlp(cfg, layer) if mlp is not None else MLP(cfg)
        self.sparse = isinstance(self.mlp, SparseMoE)  # takes the token mask (padding stays out of balancing)

    def forward(
        self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: AttentionContext
    ) -> torch.Tensor:
        h = h + self.attn(self.input_norm(h), cos, sin, ctx, self.sliding)
        x = self.post_attn_norm(h)
        return h + (self.mlp(x, ctx.tokens) if self.sparse else self.mlp(x))


def _init_normal(module: nn.Module, name: str, std: float, seed: int) -> None:
    _normal(module.weight, name, std, seed)
    if getattr(module, "bias", None) is not None:
        module.bias.zero_()


def _normal(param: torch.Tensor, name: str, std: float, seed: int) -> None:
    """normal(0, std) from a generator of its own, seeded by the seed and the parameter's name."""
    generator = torch.Generator(param.device)
    generator.manual_seed(seed + zlib.crc32(name.encode()))
    param.normal_(0.0, std, generator=generator)


class Decoder(StagedModel):
    """Token ids -> logits. `position_ids` and `doc_ids` (or the faster `doc_layout`) describe packed rows
    (positions restart per document); `output_mask` [b, s] limits the LM head to those positions. A
    pipeline stage is a `part` of it: the same forward, from and to the residual stream. Context parallel
    (installed from outside, parallel/context_parallel.py) sets `sequence_split`: the rows' sequence is
    split over ranks and its `context(cfg, position_ids, doc_ids)` makes each forward's attention."""

    def __init__(self, cfg: DecoderConfig, mlp: MLPFactory | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, i, mlp) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.num_labels or cfg.vocab_size, bias=False)
        self.value_head: nn.Linear | None = None  # PPO's critic on the policy (attach_value_head)
        self.critic: nn.Module | None = None  # or PPO's separate critic model (attach_critic)
        self.tie_weights()
        self.register_buffer("inv_freq", torch.empty(cfg.head_dim // 2), persistent=False)
        self.reset_rope()

    def tie_weights(self) -> None:
        """Share the embedding with the LM head when the checkpoint says so (again after `to_empty`). A
        pipeline stage may hold only one of them, or its own copy of the head (parallel/pipeline.py)."""
        whole = self.embed_tokens is not None and self.lm_head is not None
        if self.config.tie_embeddings and whole and not self.untied_copy:
            self.lm_head.weight = self.embed_tokens.weight

    def _apply(self, fn: Callable, recurse: bool = True) -> Decoder:
        # Keep RoPE frequencies in fp32 whatever dtype the weights are cast to (as HF computes them).
        out = super()._apply(fn, recurse)
        if self.inv_freq.device.type != "meta":
            self.reset_rope()
        return out

    def reset_buffers(self) -> None:
        """Buffers after `to_empty` (which leaves them unset): RoPE frequencies, zero expert biases."""
        self.reset_rope()
        for module in self.modules():
            if isinstance(module, SparseMoE):
                module.gate.bias.zero_()

    def reset_rope(self) -> None:
        """(Re)compute RoPE frequencies; needed after building on the meta device."""
        cfg = self.config
        freq = inv_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        self.inv_freq = freq.to(self.inv_freq.device) if self.inv_freq.device.type != "meta" else freq

    @torch.no_grad()
    def init_weights(self, std: float = 0.02, seed: int = 0) -> None:
        """Fresh weights for training from scratch (HF's scheme: normal(0, std), zero bias, unit norms). Each
        module draws from its own generator, seeded by the seed and its name, so a model split into
        pipeline stages (each built alone) gets exactly the weights the whole model would."""
        for name, module in self.named_modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                if name == "lm_head" and self.config.tie_embeddings:
                    name = "embed_tokens"  # the tied head (or a stage's copy of it) is the embedding
                _init_normal(module, name, std, seed)
            elif isinstance(module, RMSNorm):
                module.weight.fill_(1.0)
            elif isinstance(module, SparseMoE):  # the router and the 3-D expert weights (not nn.Linear)
                _normal(module.gate.weight, f"{name}.gate", std, seed)
                _normal(module.experts.gate_up_proj, f"{name}.experts.gate_up_proj", std, seed)
                _normal(module.experts.down_proj, f"{name}.experts.down_proj", std, seed)

    @torch.no_grad()
    def init_head(self, std: float = 0.02, seed: int = 0) -> None:
        """Fresh weights for the head alone (a score head put on a pretrained body), as `init_weights` would
        draw them."""
        if self.lm_head is not None:
            _init_normal(self.lm_head, "lm_head", std, seed)

    def canonical_name(self, name: str) -> str:
        """A parameter's name as this model spells it (the generic backend maps transformers' names)."""
        return name

    def blocks(self) -> list[nn.Module]:
        """The decoder blocks this model holds, in order (all of them, or a pipeline stage's)."""
        return list(self.layers.values() if isinstance(self.layers, nn.ModuleDict) else self.layers)

    def indexed_blocks(self) -> list[tuple[int, nn.Module]]:
        """`blocks()` with each one's index in the whole model."""
        if isinstance(self.layers, nn.ModuleDict):
            return [(int(k), m) for k, m in self.layers.items()]
        return list(enumerate(self.layers))

    def prune(self, layers: list[int], first: bool, last: bool) -> None:
        """Keep only what a pipeline rank holds, in place (on the meta device: nothing is ever allocated for
        the rest): the given layers, as a ModuleDict keyed by their original index so names stay
        `layers.<i>....`; the embedding if `first`; the final norm and head if `last`. A last stage without
        the first gets its own copy of a tied embedding as its head (`untied_copy`: init and loading fill
        it as the embedding; the pipeline sums the two gradients)."""
        self.layers = nn.ModuleDict({str(i): self.layers[i] for i in layers})
        if not first:
            self.embed_tokens = None
        if not last:
            self.norm = self.lm_head = None
        elif self.config.tie_embeddings:
            weight = self.lm_head.weight
            self.lm_head.weight = nn.Parameter(torch.empty_like(weight), requires_grad=weight.requires_grad)
            self.untied_copy = True  # tie_weights() leaves the copy alone

    def part(self, layers: list[int], first: bool, last: bool) -> Decoder:
        """A view of some of this model (a pipeline stage): the given layers (original indices), the
        embedding if `first`, the final norm and LM head if `last`. Its modules and RoPE buffer are this
        model's, under the same names, so it allocates nothing and runs this model's forward."""
        view = object.__new__(type(self))
        nn.Module.__init__(view)
        view.config = self.config
        view.sequence_split = self.sequence_split
        view.embed_tokens = self.embed_tokens if first else None
        held = self.layers
        view.layers = nn.ModuleDict(
            {str(i): held[str(i)] if isinstance(held, nn.ModuleDict) else held[i] for i in layers}
        )
        view.norm = self.norm if last else None
        view.lm_head = self.lm_head if last else None
        view.value_head = self.value_head if last else None
        view.critic = None  # a separate critic is not cut into stages (refused under a pipeline)
        view.register_buffer("inv_freq", self.inv_freq, persistent=False)
        return view

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_cos_sin(positions, self.inv_freq, dtype)

    def layer_inputs(
        self,
        position_ids: torch.Tensor,
        dtype: torch.dtype,
        doc_ids: torch.Tensor | None = None,
        doc_layout: DocLayout | None = None,
        cache: Cache | None = None,
        rotary: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionContext]:
        """What every block takes besides the stream: RoPE cos/sin (of `rotary` positions where they are
        not the tokens' own) and how tokens may attend (computed from the token positions [b, s], not the
        stream, which sequence parallel splits)."""
        cos, sin = self.rope(position_ids if rotary is None else rotary, dtype)
        if cache is None and self.sequence_split is not None:  # doc_ids: the whole rows'
            return cos, sin, self.sequence_split.context(self.config, position_ids, doc_ids)
        ctx = attention_context(self.config, position_ids, doc_ids, doc_layout, cache)
        if self.config.num_experts and cache is None:
            ctx.tokens = real_tokens(position_ids, doc_ids)
        return cos, sin, ctx

    def final_hidden(self, h: torch.Tensor, output_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Final norm; `output_mask` [b, s] keeps only the positions that are scored ([n, hidden])."""
        h = self.norm(h)
        return h[output_mask] if output_mask is not None else h

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head (or a reward model's score head) over final hidden states."""
        return self.lm_head(hidden)

    def target_logprobs(self, hidden: torch.Tensor, targets: torch.Tensor, summed: bool) -> torch.Tensor:
        """log p(target) per row of `hidden` [n], a chunk at a time (models/head.py)."""
        return target_logprobs(self.lm_head, hidden, targets, summed)

    def forward(
        self,
        x: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        doc_ids: torch.Tensor | None = None,
        doc_layout: DocLayout | None = None,
        output_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
        head: Head | None = None,
        images: ImageInputs | None = None,
    ) -> HeadOutput:
        """`x`: token ids [b, s], or the residual stream [b, s, hidden] where there is no embedding (a later
        pipeline stage). Returns what `head` makes of the final hidden states at the positions `output_mask`
        [b, s] keeps (models/head.py; None: logits), or the stream after the blocks where there is no head
        (an earlier pipeline stage). With `cache`, this forward's keys and values are added to it and
        attention covers all it holds. `images`: a vision-language family's (their tokens in `x`)."""
        if position_ids is None:
            position_ids = self.default_positions(x, cache, images)
        h = self.hidden(x, position_ids, doc_ids, doc_layout, cache, images)
        if self.lm_head is None:
            return h
        return apply_head(self, h, head, HeadInput(x, position_ids, doc_ids, doc_layout, output_mask))

    def default_positions(
        self, x: torch.Tensor, cache: Cache | None, images: ImageInputs | None
    ) -> torch.Tensor:
        """Positions of rows of one sequence each, after what `cache` holds."""
        start = cache.filled if cache is not None else 0
        b, s = x.shape[:2]
        return torch.arange(start, start + s, device=x.device).expand(b, s)

    def embed(self, x: torch.Tensor, images: ImageInputs | None) -> torch.Tensor:
        """The stream the blocks take: the tokens' embeddings where this part has the embedding, else `x`
        itself (a later pipeline stage's stream). A text family takes no images."""
        if images is not None:
            raise ModelError(f"{self.config.family} is a text model: it takes no images")
        return self.embed_tokens(x) if self.embed_tokens is not None else x

    def hidden(
        self,
        x: torch.Tensor,
        position_ids: torch.Tensor,
        doc_ids: torch.Tensor | None = None,
        doc_layout: DocLayout | None = None,
        cache: Cache | None = None,
        images: ImageInputs | None = None,
    ) -> torch.Tensor:
        """The body: the embedding (where this part has it) and the blocks, up to the final norm."""
        images = self.encode_images(images)
        h = self.embed(x, images)
        rotary = self.rotary_positions(x, position_ids, images)
        cos, sin, ctx = self.layer_inputs(position_ids, h.dtype, doc_ids, doc_layout, cache, rotary)
        for index, layer in self.indexed_blocks():
            h = self.after_block(index, layer(h, cos, sin, ctx), x, images)
        if cache is not None:
            cache.advance(position_ids.shape[-1])
        return h

    def encode_images(self, images: ImageInputs | None) -> ImageInputs | None:
        """The images with their embeddings, made once per forward (a vision-language family's)."""
        return images

    def after_block(
        self, index: int, h: torch.Tensor, x: torch.Tensor, images: ImageInputs | None
    ) -> torch.Tensor:
        """The stream after block `index` (whole-model numbering), where a family adds to it (Qwen3-VL's
        deepstack features)."""
        return h
