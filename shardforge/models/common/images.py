"""What a vision-language model's forward takes besides token ids: a batch's images, as its processor made
them (a leaf: models, data and inference all pass it along)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ImageInputs:
    """Every image of a batch, in the order their placeholder tokens appear (row by row): the processor's
    flattened patches [patches, features] and each image's (t, h, w) patch grid [images, 3]. The inference
    engine encodes a request's images once and passes, per step, the `embeddings` of the image tokens the
    step holds [tokens, hidden] and the rotary `positions` of its tokens (Qwen2-VL's M-RoPE [3, b, s]; the
    KV cache's own positions stay the sequence's) instead."""

    pixel_values: torch.Tensor
    grid_thw: torch.Tensor
    embeddings: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    slots: torch.Tensor | None = (
        None  # [b, s] where the embeddings go (a prompt's image tokens, not new ones)
    )

    def to(self, device: torch.device | str) -> ImageInputs:
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        pixels, grids = self.pixel_values.to(device), self.grid_thw.to(device)
        return ImageInputs(pixels, grids, move(self.embeddings), move(self.positions), move(self.slots))

    @classmethod
    def encoded(
        cls, embeddings: torch.Tensor, positions: torch.Tensor | None, slots: torch.Tensor
    ) -> ImageInputs:
        """A step's images as the engine passes them (already encoded)."""
        none = torch.zeros(0, dtype=torch.long, device=embeddings.device)
        return cls(none, none.view(0, 3), embeddings, positions, slots)


@dataclass(frozen=True)
class ImagePrompt:
    """How a family's prompt holds one image: `before`, its image token once per image embedding, `after`
    (Qwen2-VL: <|vision_start|> <|image_pad|> x n <|vision_end|>; LLaVA: <image> x 576), and the family's
    limits on an image's sides (LLaMA-Factory's plugin of the family applies them before the processor)."""

    token_id: int
    token: str
    before: str = ""
    after: str = ""
    merge: int = 1  # patches per image token along each side (Qwen2-VL's patch merger: 2)
    fixed: int = 0  # tokens per image whatever its size (LLaVA's resized crop); 0: from the patch grid
    min_side: int = 0  # pixels an image's shorter side is raised to (Qwen2-VL: 28)
    max_aspect: float = 0.0  # a longer / shorter side above this is cut to 180 (Qwen2-VL: 200); 0: none
    patch: int = 1  # pixels per patch side where the processor gives whole images (LLaVA's tower: 14)

    def tokens(self, grid: tuple[int, int, int]) -> int:
        """Image tokens of an image whose (t, h, w) patch grid is `grid`."""
        if self.fixed:
            return self.fixed
        t, h, w = grid
        return t * h * w // (self.merge * self.merge)

    def text(self, grid: tuple[int, int, int]) -> str:
        return self.before + self.token * self.tokens(grid) + self.after
