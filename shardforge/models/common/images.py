"""What a vision-language model's forward takes besides token ids: a batch's images, as its processor made
them (a leaf: models, data and inference all pass it along)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ImageInputs:
    """Every image of a batch, in the order their placeholder tokens appear (row by row): the processor's
    flattened patches [patches, features] and each image's (t, h, w) patch grid [images, 3]."""

    pixel_values: torch.Tensor
    grid_thw: torch.Tensor

    def to(self, device: torch.device | str) -> ImageInputs:
        return ImageInputs(self.pixel_values.to(device), self.grid_thw.to(device))


@dataclass(frozen=True)
class ImagePrompt:
    """How a family's prompt holds one image: `before`, its image token once per merged patch, `after`
    (Qwen2-VL: <|vision_start|> <|image_pad|> x n <|vision_end|>)."""

    token_id: int
    token: str
    before: str
    after: str
    merge: int  # patches per image token along each side

    def tokens(self, grid: tuple[int, int, int]) -> int:
        """Image tokens of an image whose (t, h, w) patch grid is `grid`."""
        t, h, w = grid
        return t * h * w // (self.merge * self.merge)

    def text(self, grid: tuple[int, int, int]) -> str:
        return self.before + self.token * self.tokens(grid) + self.after
