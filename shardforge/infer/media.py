"""A request's images in the engine: encoded once when it is added (the model's tower), then each step takes
the embeddings of the image tokens it holds and, for a family with rotary positions of its own (Qwen2-VL's
M-RoPE), the positions of its tokens: the prompt's as the family lays them out, the new tokens' after
them. The images' content salts the request's prefix-cache keys, so two prompts alike in tokens but not in
images never share cached blocks."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import torch

from shardforge.models.common.images import ImageInputs
from shardforge.models.common.protocol import CausalModel


@dataclass(frozen=True)
class RequestImages:
    """A prompt's encoded images: `embeddings` [image tokens, hidden] for the prompt's image tokens at
    `slots` (their indices, in order); `rotary` [3, prompt] the prompt's rotary positions (None: the
    tokens' own), and `delta`, what a new token's position adds to its index; `salt`, the images' digest."""

    embeddings: torch.Tensor
    slots: np.ndarray
    rotary: torch.Tensor | None
    delta: int
    salt: bytes

    @classmethod
    def encode(cls, model: CausalModel, prompt: list[int], images: ImageInputs) -> RequestImages:
        device = next(model.parameters()).device
        ids = torch.tensor(prompt, device=device)[None]
        dtype = model.embed_tokens.weight.dtype
        digest = hashlib.sha256(images.pixel_values.detach().cpu().numpy().tobytes())  # as sent
        digest.update(images.grid_thw.detach().cpu().numpy().tobytes())
        images = images.to(device)
        embeddings = model.image_embeddings(images, dtype)
        positions = torch.arange(len(prompt), device=device)[None]
        rotary = model.rotary_positions(ids, positions, images)
        own = rotary.dim() == 2
        return cls(
            embeddings,
            np.flatnonzero(np.asarray(prompt) == model.config.image_token_id),
            None if own else rotary[:, 0],
            0 if own else int(rotary.max()) + 1 - len(prompt),
            digest.digest(),
        )

    def rows(self, start: int, end: int) -> torch.Tensor:
        """The embeddings of the image tokens among prompt positions [start, end)."""
        first, last = np.searchsorted(self.slots, [start, end])
        return self.embeddings[first:last]

    def positions(self, start: int, end: int, prompt_len: int) -> torch.Tensor:
        """[3, end - start] rotary positions of tokens [start, end): the prompt's, then index + delta."""
        device = self.embeddings.device
        index = torch.arange(start, end, device=device)
        out = (index + self.delta).expand(3, -1).clone()
        if self.rotary is not None and start < prompt_len:
            cut = min(end, prompt_len)
            out[:, : cut - start] = self.rotary[:, start:cut]
        return out


def step_images(parts: list[tuple[RequestImages | None, int, int, int]], hidden: int) -> ImageInputs | None:
    """The step's images: for each sequence's part (its images, first token, end, prompt length), the
    embeddings of its prompt's image tokens and where they go (a new token that happens to be the image
    token is a token: transformers embeds it as one), and the rotary positions of every token where any part
    has its own (a part without images: its tokens' own, three times). None where no part has images."""
    if all(media is None for media, *_ in parts):
        return None
    device = next(m for m, *_ in parts if m is not None).embeddings.device
    rows, positions, slots = [], [], []
    for media, start, end, prompt_len in parts:
        mask = torch.zeros(end - start, dtype=torch.bool)
        if media is None:
            positions.append(torch.arange(start, end, device=device).expand(3, -1))
            slots.append(mask)
            continue
        held = media.slots[(media.slots >= start) & (media.slots < end)]  # a new image token is a token
        mask[torch.from_numpy(held - start)] = True
        slots.append(mask)
        rows.append(media.rows(start, end))
        positions.append(media.positions(start, end, prompt_len))
    embeddings = torch.cat(rows) if rows else torch.zeros(0, hidden, device=device)
    own = all(m is None or m.rotary is None for m, *_ in parts)
    rotary = None if own else torch.cat(positions, dim=1)[:, None]
    return ImageInputs.encoded(embeddings, rotary, torch.cat(slots)[None].to(device))
