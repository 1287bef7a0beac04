"""The engine's fallback for a family whose attention does not go through the paged KV cache (transformers'
falcon and stablelm, among others, attend without calling their attention interface with the step's cache:
executor.py finds it out). Such a family is still served right, only slower: no keys or values are kept;
the step's tokens are kept instead, in slots of the same block tables the scheduler hands out (so the prefix
cache, copy-on-write and preemption need nothing new), and every sequence that samples in a step runs whole
through the model's own forward, the sequences batched as right-padded rows (causal attention: no real token
sees the padding after it). A step costs a forward over every sampled sequence's whole length, where the
paged path costs one over its new tokens."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from shardforge.infer.executor import StepInput, whole_vocabulary
from shardforge.models.common.images import ImageInputs
from shardforge.models.common.protocol import CausalModel


class RecomputeRunner:
    """A model runner (executor.py's protocol) that recomputes each sampled sequence from its tokens."""

    def __init__(self, model: CausalModel, num_blocks: int, block_size: int) -> None:
        self.model, self.block_size = model, block_size
        self.device = next(model.parameters()).device
        self.tokens = np.zeros(num_blocks * block_size, dtype=np.int64)  # each slot's token id
        self.images: dict[int, torch.Tensor] = {}  # a prompt's image token's slot -> its image embedding

    def _write(self, slots: np.ndarray, ids: np.ndarray, placed: torch.Tensor | None, rows: Any) -> None:
        """Tokens into their slots, with the image embeddings of those among them a prompt's images hold
        (`placed` [len(slots)] marks them; `rows` yields their embeddings in order)."""
        self.tokens[slots] = ids
        for slot in slots.tolist():
            self.images.pop(slot, None)
        if placed is not None:
            for slot in slots[placed.cpu().numpy()].tolist():
                self.images[slot] = next(rows)

    @torch.no_grad()
    def run(self, step: StepInput) -> torch.Tensor:
        bs, lo = self.block_size, 0
        rows: list[np.ndarray] = []  # each sampling sequence's whole token ids
        sampled: list[list[int]] = []  # its sampled positions
        order: list[int] = []  # the step's row index of each sampled position, in that order
        wanted = set(step.last)
        images = step.images
        embeddings = iter(images.embeddings) if images is not None else iter(())
        slots: list[np.ndarray] = []  # each sampling sequence's slots
        for chunk in step.chunks:
            for src, dst in zip(chunk.copy_from, chunk.blocks, strict=False):
                copied = np.arange(src * bs, (src + 1) * bs)
                held = [self.images.get(slot) for slot in copied.tolist()]
                self._write(copied - src * bs + dst * bs, self.tokens[copied], None, None)
                self.images.update({dst * bs + k: e for k, e in enumerate(held) if e is not None})
            end = chunk.start + chunk.length
            table = np.asarray(chunk.blocks)
            positions = np.arange(chunk.start, end)
            placed = None if images is None else images.slots[0, lo : lo + chunk.length]
            at = table[positions // bs] * bs + positions % bs
            self._write(at, step.ids[lo : lo + chunk.length], placed, embeddings)
            mine = [r for r in range(lo, lo + chunk.length) if r in wanted]
            if mine:
                whole = np.arange(end)
                slots.append(table[whole // bs] * bs + whole % bs)
                rows.append(self.tokens[slots[-1]])
                sampled.append([chunk.start + r - lo for r in mine])
                order.extend(mine)
            lo += chunk.length
        vocab = self.model.config.vocab_size
        if not rows:
            return torch.empty(0, vocab, dtype=torch.float32, device=self.device)
        longest = max(len(r) for r in rows)
        ids = torch.zeros(len(rows), longest, dtype=torch.long)
        mask = torch.zeros(len(rows), longest, dtype=torch.bool)
        for i, (row, positions) in enumerate(zip(rows, sampled, strict=True)):
            ids[i, : len(row)] = torch.from_numpy(row)
            mask[i, positions] = True
        position_ids = torch.arange(longest, device=self.device)[None].expand(len(rows), -1)
        pictures = self._images(slots, longest)
        logits = self.model(
            ids.to(self.device), position_ids, output_mask=mask.to(self.device), images=pictures
        )
        logits = whole_vocabulary(logits, vocab).float()  # the sampled positions, row by row
        # back to the step's order (`last`): the mask's positions come row-major, i.e. in `order`
        at = {row: i for i, row in enumerate(order)}
        return logits[torch.tensor([at[r] for r in step.last], device=self.device)]

    def _images(self, slots: list[np.ndarray], width: int) -> ImageInputs | None:
        """The sequences' prompt images, as the model's forward takes them encoded: their embeddings, row
        after row, and where they go [rows, width]."""
        if not self.images:
            return None
        placed = torch.zeros(len(slots), width, dtype=torch.bool)
        found = []
        for r, row in enumerate(slots):
            for k, slot in enumerate(row.tolist()):
                if slot in self.images:
                    placed[r, k] = True
                    found.append(self.images[slot])
        if not found:
            return None
        return ImageInputs.encoded(torch.stack(found), None, placed.to(self.device))
