"""Greedy generation over a batch of prompts, with the model's KV cache."""

from __future__ import annotations

import torch
from torch import nn

from shardforge.models.llama.model import KVCache


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
