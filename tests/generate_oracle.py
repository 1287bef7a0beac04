"""The test oracle of the inference engine (infer/engine.py): greedy generation over a batch of prompts with
a contiguous KV cache, the simplest correct way, which the engine's paged, continuously batched tokens are
compared with (and this with transformers' generate)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from shardforge.models.common.attention import AttentionContext, sdpa
from shardforge.models.common.config import DecoderConfig


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


@torch.no_grad()
def generate(
    model: nn.Module,
    prompts: list[list[int]],
    max_new_tokens: int,
    eos_token_id: int | None = None,
    pad_token_id: int = 0,
) -> list[list[int]]:
    """Each prompt's greedy continuation: its new tokens, up to and including `eos_token_id` if given (a
    stopped row waits for the others). The prompts are left-padded into one batch, so every row's next
    token is in the last column; positions start at 0 at each row's first real token and padding is masked
    out of attention, so a row's tokens do not depend on the rest of its batch. The prompts are run once
    (prefill), then one token per step, attending over the cache. Puts the model in eval mode."""
    if not prompts or min(map(len, prompts)) == 0:
        raise ValueError("generate needs at least one prompt, and every prompt at least one token")
    model.eval()
    device = next(model.parameters()).device
    width = max(map(len, prompts))
    pads = torch.tensor([width - len(p) for p in prompts], device=device)
    ids = torch.tensor([[pad_token_id] * (width - len(p)) + list(p) for p in prompts], device=device)
    slots = torch.arange(width + max_new_tokens, device=device)
    cache = KVCache(max_len=width + max_new_tokens, key_mask=slots[None, :] >= pads[:, None])
    positions = (slots[None, :width] - pads[:, None]).clamp(min=0)
    last = torch.zeros(ids.shape, dtype=torch.bool, device=device)
    last[:, -1] = True
    logits = model(ids, positions, output_mask=last, cache=cache)  # [batch, vocab]: the last column only
    position = positions[:, -1:]
    new: list[list[int]] = [[] for _ in prompts]
    running = set(range(len(prompts)))
    for step in range(max_new_tokens):
        tokens = logits.argmax(-1)
        for row, token in enumerate(tokens.tolist()):
            if row in running:
                new[row].append(token)
                if token == eos_token_id:
                    running.discard(row)
        if not running or step == max_new_tokens - 1:
            break
        position = position + 1
        logits = model(tokens[:, None], position, cache=cache)[:, -1]
    return new
