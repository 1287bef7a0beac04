"""The Llama decoder family in plain PyTorch. No parallel code here: layouts are applied from outside."""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from shardforge.models.attention import DocLayout, attention_per_document
from shardforge.models.llama.config import DecoderConfig
from shardforge.models.llama.rope import apply_rope, inv_frequencies, rope_cos_sin


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=cfg.o_bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_eps) if cfg.qk_norm else None

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: AttentionContext, sliding: bool
    ) -> torch.Tensor:
        b, s, _ = x.shape
        # -1 instead of the head count keeps this correct when TP shards the projections by heads.
        q = self.q_proj(x).view(b, s, -1, self.head_dim)
        k = self.k_proj(x).view(b, s, -1, self.head_dim)
        v = self.v_proj(x).view(b, s, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        groups = q.shape[1] // k.shape[1]
        if groups > 1:
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
        if ctx.layout is not None:
            out = attention_per_document(q, k, v, ctx.layout, ctx.window if sliding else None)
        else:
            mask = ctx.sliding if sliding else ctx.full
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, cfg: DecoderConfig, layer: int) -> None:
        super().__init__()
        self.sliding = cfg.is_sliding(layer)
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.attn = Attention(cfg)
        self.post_attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.mlp = MLP(cfg)

    def forward(
        self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: AttentionContext
    ) -> torch.Tensor:
        h = h + self.attn(self.input_norm(h), cos, sin, ctx, self.sliding)
        return h + self.mlp(self.post_attn_norm(h))


@dataclass
class AttentionContext:
    """How tokens may attend, computed once per forward: boolean masks [b, 1, s, s] (True = attend; None =
    plain causal) for full and sliding-window layers, or a per-document layout for packed rows."""

    full: torch.Tensor | None = None
    sliding: torch.Tensor | None = None
    layout: DocLayout | None = None
    window: int | None = None


def attention_context(
    cfg: DecoderConfig, seq: int, doc_ids: torch.Tensor | None, layout: DocLayout | None, device: torch.device
) -> AttentionContext:
    if layout is not None:
        return AttentionContext(layout=layout, window=cfg.sliding_window)
    needs_window = cfg.sliding_window is not None and seq > cfg.sliding_window
    if doc_ids is None and not needs_window:
        return AttentionContext()
    pos = torch.arange(seq, device=device)
    allowed = (pos[None, :] <= pos[:, None])[None]
    if doc_ids is not None:
        allowed = allowed & (doc_ids[:, :, None] == doc_ids[:, None, :])
    full = allowed[:, None]
    if not needs_window:
        return AttentionContext(full=full, sliding=full)
    window = (pos[:, None] - pos[None, :]) < cfg.sliding_window
    return AttentionContext(full=full, sliding=full & window[None, None])


class Decoder(nn.Module):
    """Token ids -> logits. `position_ids` and `doc_ids` (or the faster `doc_layout`) describe packed rows
    (positions restart per document); `output_mask` [b, s] limits the LM head to those positions."""

    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()
        self.register_buffer("inv_freq", torch.empty(cfg.head_dim // 2), persistent=False)
        self.reset_rope()

    def tie_weights(self) -> None:
        """Share the embedding with the LM head when the checkpoint says so (again after `to_empty`). A
        pipeline stage may hold only one of them, or its own copy of the head (parallel/pipeline.py)."""
        whole = self.embed_tokens is not None and self.lm_head is not None
        if self.config.tie_embeddings and whole and not getattr(self, "untied_copy", False):
            self.lm_head.weight = self.embed_tokens.weight

    def _apply(self, fn: Callable, recurse: bool = True) -> Decoder:
        # Keep RoPE frequencies in fp32 whatever dtype the weights are cast to (as HF computes them).
        out = super()._apply(fn, recurse)
        if self.inv_freq.device.type != "meta":
            self.reset_rope()
        return out

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
                generator = torch.Generator(module.weight.device)
                generator.manual_seed(seed + zlib.crc32(name.encode()))
                module.weight.normal_(0.0, std, generator=generator)
                if getattr(module, "bias", None) is not None:
                    module.bias.zero_()
            elif isinstance(module, RMSNorm):
                module.weight.fill_(1.0)

    def blocks(self) -> list[nn.Module]:
        """The decoder blocks this model holds, in order (all of them, or a pipeline stage's)."""
        return list(self.layers.values() if isinstance(self.layers, nn.ModuleDict) else self.layers)

    def layer_inputs(
        self,
        position_ids: torch.Tensor,
        dtype: torch.dtype,
        doc_ids: torch.Tensor | None = None,
        doc_layout: DocLayout | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionContext]:
        """What every block takes besides the stream: RoPE cos/sin and how tokens may attend (computed from
        the token positions [b, s], not the stream, which sequence parallel splits)."""
        cos, sin = rope_cos_sin(position_ids, self.inv_freq, dtype)
        ctx = attention_context(self.config, position_ids.shape[1], doc_ids, doc_layout, position_ids.device)
        return cos, sin, ctx

    def head(self, h: torch.Tensor, output_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Final norm and LM head; `output_mask` [b, s] limits them to the positions that are scored."""
        h = self.norm(h)
        if output_mask is not None:  # only the positions that are scored: [n, vocab]
            h = h[output_mask]
        return self.lm_head(h)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        doc_ids: torch.Tensor | None = None,
        doc_layout: DocLayout | None = None,
        output_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if position_ids is None:
            b, s = input_ids.shape
            position_ids = torch.arange(s, device=input_ids.device).expand(b, s)
        h = self.embed_tokens(input_ids)
        cos, sin, ctx = self.layer_inputs(position_ids, h.dtype, doc_ids, doc_layout)
        for layer in self.blocks():
            h = layer(h, cos, sin, ctx)
        return self.head(h, output_mask)
