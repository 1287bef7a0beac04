"""The Llama decoder family in plain PyTorch. No parallel code here: layouts are applied from outside."""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from shardforge.models.attention import DocLayout, attention_per_document, sdpa
from shardforge.models.head import critic_values, target_logprobs, value_head
from shardforge.models.llama.config import DecoderConfig
from shardforge.models.llama.rope import apply_rope, inv_frequencies, rope_cos_sin
from shardforge.models.moe import SparseMoE


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
    def __init__(self, cfg: DecoderConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer  # its slot in a KV cache
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
        if ctx.cache is not None:
            out = ctx.cache.attend(self.layer, q, k, v, sliding)
        elif ctx.layout is not None:
            out = attention_per_document(q, k, v, ctx.layout, ctx.window if sliding else None)
        else:
            out = sdpa(q, k, v, ctx.sliding if sliding else ctx.full)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


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


@dataclass
class KVCache:
    """Keys and values of the tokens seen so far, preallocated per layer as [batch, kv_heads, max_len,
    head_dim] (on first use: the local head count under TP, the stream's dtype) so that decoding writes in
    place instead of concatenating. The rows of a batch share the slots; each slot's absolute position is
    kept per row (left-padded rows differ) for the sliding window, and `key_mask` [batch, max_len] marks
    the real tokens (False: padding, never attended; None: all real). One cache per module that runs the
    forward: the forward advances `filled` by its length."""

    max_len: int
    key_mask: torch.Tensor | None = None
    filled: int = 0
    positions: torch.Tensor | None = None  # [batch, max_len]
    keys: dict[int, torch.Tensor] = field(default_factory=dict)  # layer index -> keys
    values: dict[int, torch.Tensor] = field(default_factory=dict)
    masks: tuple = ()  # this forward's (full, sliding-window) masks [b, 1, s, filled + s], from context()

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sliding: bool
    ) -> torch.Tensor:
        """Store this forward's k, v [b, kv_heads, s, d] after the filled slots, then attend over all the
        filled ones (with the forward's sliding-window mask on a sliding layer)."""
        b, heads, s, d = k.shape
        if layer not in self.keys:
            self.keys[layer] = k.new_zeros(b, heads, self.max_len, d)
            self.values[layer] = v.new_zeros(b, heads, self.max_len, d)
        end = self.filled + s
        self.keys[layer][:, :, self.filled : end] = k
        self.values[layer][:, :, self.filled : end] = v
        mask = self.masks[1] if sliding else self.masks[0]
        return sdpa(q, self.keys[layer][:, :, :end], self.values[layer][:, :, :end], mask)

    def context(self, cfg: DecoderConfig, position_ids: torch.Tensor) -> AttentionContext:
        """The s queries of this forward come after `filled` cached keys, so the masks [b, 1, s, filled + s]
        are explicit (SDPA's `is_causal` aligns the query block with the first keys, which is wrong here)."""
        b, s = position_ids.shape
        start, end = self.filled, self.filled + s
        if end > self.max_len:
            raise ValueError(f"the KV cache holds {self.max_len} positions: {start} filled, {s} more given")
        if self.positions is None:
            self.positions = position_ids.new_zeros(b, self.max_len)
        self.positions[:, start:end] = position_ids
        slots = torch.arange(end, device=position_ids.device)
        mine = slots[None, :] == slots[start:, None]
        allowed = (slots[None, :] <= slots[start:, None])[None]  # [1, s, end]: earlier slots
        if self.key_mask is not None:
            allowed = allowed & self.key_mask[:, None, :end]
        allowed = (allowed | mine)[:, None]  # a padding query sees itself: no empty softmax row (NaN)
        self.masks = (allowed, allowed)
        if cfg.sliding_window is not None:
            distance = position_ids[:, :, None] - self.positions[:, None, :end]  # absolute positions, per row
            self.masks = (allowed, allowed & (distance < cfg.sliding_window)[:, None])
        return AttentionContext(cache=self)

    def advance(self, n: int) -> None:
        self.filled += n


class Cache(Protocol):
    """What a forward with a cache calls: `context` once (the cache makes and keeps this forward's masks),
    `attend` per layer (store this forward's keys and values, attend over what the cache holds, with the
    sliding-window mask on a sliding layer), `advance` at the end. `KVCache` is the
    contiguous one of `generate`; infer/paged.py has the paged one of the engine."""

    def context(self, cfg: DecoderConfig, position_ids: torch.Tensor) -> AttentionContext: ...

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sliding: bool
    ) -> torch.Tensor: ...

    def advance(self, n: int) -> None: ...


@dataclass
class AttentionContext:
    """How tokens may attend, computed once per forward: boolean masks [b, 1, s, keys] (True = attend; None =
    plain causal) for full and sliding-window layers, or a per-document layout for packed rows, and the
    KV cache the layers write to."""

    full: torch.Tensor | None = None
    sliding: torch.Tensor | None = None
    layout: DocLayout | None = None
    window: int | None = None
    cache: Cache | None = None
    tokens: torch.Tensor | None = None  # [b, s] True at real tokens (set for MoE models: real_tokens)


def real_tokens(
    position_ids: torch.Tensor, doc_ids: torch.Tensor | None, columns: torch.Tensor | None = None
) -> torch.Tensor:
    """Which positions hold tokens rather than padding, as collate lays rows out: padding has document id
    -1 in packed rows, and position 0 after a row's first column in rows of one document. `columns`: the
    positions' columns in their whole rows (a context-parallel rank holds parts of rows)."""
    if doc_ids is not None:
        return doc_ids >= 0
    if columns is None:
        columns = torch.arange(position_ids.shape[1], device=position_ids.device)
    return (position_ids > 0) | (columns == 0)


def attention_context(
    cfg: DecoderConfig,
    position_ids: torch.Tensor,
    doc_ids: torch.Tensor | None,
    layout: DocLayout | None,
    cache: Cache | None = None,
) -> AttentionContext:
    if cache is not None:
        if doc_ids is not None or layout is not None:
            raise ValueError("a KV cache holds one sequence per row: packed rows (doc_ids) cannot use it")
        return cache.context(cfg, position_ids)
    if layout is not None:
        return AttentionContext(layout=layout, window=cfg.sliding_window)
    seq, device = position_ids.shape[1], position_ids.device
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


def _init_normal(module: nn.Module, name: str, std: float, seed: int) -> None:
    _normal(module.weight, name, std, seed)
    if getattr(module, "bias", None) is not None:
        module.bias.zero_()


def _normal(param: torch.Tensor, name: str, std: float, seed: int) -> None:
    """normal(0, std) from a generator of its own, seeded by the seed and the parameter's name."""
    generator = torch.Generator(param.device)
    generator.manual_seed(seed + zlib.crc32(name.encode()))
    param.normal_(0.0, std, generator=generator)


class Decoder(nn.Module):
    """Token ids -> logits. `position_ids` and `doc_ids` (or the faster `doc_layout`) describe packed rows
    (positions restart per document); `output_mask` [b, s] limits the LM head to those positions. A
    pipeline stage is a `part` of it: the same forward, from and to the residual stream."""

    # Context parallel (installed from outside, parallel/context_parallel.py): the rows' sequence is split
    # over ranks and its `context(cfg, position_ids, doc_ids)` makes each forward's attention.
    sequence_split = None

    def __init__(self, cfg: DecoderConfig, mlp: MLPFactory | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, i, mlp) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.num_labels or cfg.vocab_size, bias=False)
        self.value_head: nn.Linear | None = None  # PPO's critic on the policy (add_value_head); not exported
        self.critic: nn.Module | None = None  # or PPO's separate critic model (add_critic)
        self.tie_weights()
        self.register_buffer("inv_freq", torch.empty(cfg.head_dim // 2), persistent=False)
        self.reset_rope()

    def add_value_head(self, seed: int = 0) -> None:
        """PPO's critic on the final hidden states (models/head.py: value_head). A pipeline stage without the
        LM head gets none."""
        if self.lm_head is not None:
            self.value_head = value_head(self.config.hidden_size, self.norm.weight, seed)

    def add_critic(self, critic: nn.Module) -> None:
        """PPO's separate critic: a model of its own with a one-output score head, run on the policy's
        tokens when values are asked for. Held as a submodule so that the layouts, the optimizer and the
        checkpoints treat it as part of the trained model (its weights are `critic.*`)."""
        self.critic = critic

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

    def blocks(self) -> list[nn.Module]:
        """The decoder blocks this model holds, in order (all of them, or a pipeline stage's)."""
        return list(self.layers.values() if isinstance(self.layers, nn.ModuleDict) else self.layers)

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
        view.register_buffer("inv_freq", self.inv_freq, persistent=False)
        return view

    def layer_inputs(
        self,
        position_ids: torch.Tensor,
        dtype: torch.dtype,
        doc_ids: torch.Tensor | None = None,
        doc_layout: DocLayout | None = None,
        cache: Cache | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionContext]:
        """What every block takes besides the stream: RoPE cos/sin and how tokens may attend (computed from
        the token positions [b, s], not the stream, which sequence parallel splits)."""
        cos, sin = rope_cos_sin(position_ids, self.inv_freq, dtype)
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

    def head(self, h: torch.Tensor, output_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Final norm and LM head; `output_mask` [b, s] limits them to the positions that are scored."""
        return self.lm_head(self.final_hidden(h, output_mask))

    def forward(
        self,
        x: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        doc_ids: torch.Tensor | None = None,
        doc_layout: DocLayout | None = None,
        output_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
        return_hidden: bool = False,
        targets: torch.Tensor | None = None,
        summed: bool = False,
        values: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """`x`: token ids [b, s], or the residual stream [b, s, hidden] where there is no embedding (a later
        pipeline stage). Returns logits; the stream after the blocks where there is no head (an earlier
        stage); with `return_hidden` the final normed hidden states (for reward and value heads); or with
        `targets` (one per position `output_mask` keeps) their log-probabilities [n], computed a chunk at a
        time without the batch's full logits (models/head.py; `summed`: the caller sums them, as a token
        loss does), and with `values` also the value head's estimates there. With `cache`, this forward's
        keys and values are added to it and attention covers all it holds."""
        if position_ids is None:
            start = cache.filled if cache is not None else 0
            b, s = x.shape[:2]
            position_ids = torch.arange(start, start + s, device=x.device).expand(b, s)
        h = self.embed_tokens(x) if self.embed_tokens is not None else x
        cos, sin, ctx = self.layer_inputs(position_ids, h.dtype, doc_ids, doc_layout, cache)
        for layer in self.blocks():
            h = layer(h, cos, sin, ctx)
        if cache is not None:
            cache.advance(position_ids.shape[1])
        if self.lm_head is None:
            return h
        if targets is not None:
            hidden = self.final_hidden(h, output_mask)
            logps = target_logprobs(self.lm_head, hidden, targets, summed)
            if values:  # and the critic's estimates at the same positions [n] (fp32)
                inputs = {"position_ids": position_ids, "doc_ids": doc_ids, "doc_layout": doc_layout}
                return logps, critic_values(self, hidden, x, output_mask=output_mask, **inputs)
            return logps
        return self.final_hidden(h, output_mask) if return_hidden else self.head(h, output_mask)
