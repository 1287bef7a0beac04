"""What a vision-language model's forward takes besides token ids: a batch's images, as its processor made
them (a leaf: models, data and inference all pass it along)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from shardforge.errors import ModelError


@dataclass
class ImageInputs:
    """Every image of a batch, in the order their placeholder tokens appear (row by row): the processor's
    flattened patches [patches, features] and each image's (t, h, w) patch grid [images, 3]. The inference
    engine encodes a request's images once and passes, per step, the `embeddings` of the image tokens the
    step holds [tokens, hidden] and the rotary `positions` of its tokens (Qwen2-VL's M-RoPE [3, b, s]; the
    KV cache's own positions stay the sequence's) instead. `rows` [b, 2]: each row's count of images and of
    patch rows (collate's), by which a pipeline cuts the images with their rows."""

    pixel_values: torch.Tensor
    grid_thw: torch.Tensor
    embeddings: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    slots: torch.Tensor | None = None  # [b, s] where the embeddings go (a prompt's image tokens, not new)
    rows: torch.Tensor | None = None
    keep: torch.Tensor | None = None  # [image tokens] those this part places (context parallel's share)

    def to(self, device: torch.device | str) -> ImageInputs:
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        pixels, grids = self.pixel_values.to(device), self.grid_thw.to(device)
        return ImageInputs(
            pixels,
            grids,
            move(self.embeddings),
            move(self.positions),
            move(self.slots),
            move(self.rows),
            move(self.keep),
        )

    def as_rows(self) -> dict[str, torch.Tensor]:
        """The images as tensors of one entry per row, which a pipeline schedule cuts into chunks of rows
        with the tokens: each row's patches [b, most patches, features] and grids [b, most images, 3],
        zero-padded, its counts (`rows`), and the rotary positions where set ([b, 3, s] for M-RoPE's)."""
        if self.rows is None:
            raise ModelError("the images carry no per-row counts (collate's): they cannot follow rows")
        counts = self.rows.tolist()
        most_images, most_patches = (max(1, *(c[i] for c in counts)) for i in (0, 1))
        pixels = self.pixel_values.new_zeros(len(counts), most_patches, self.pixel_values.shape[-1])
        grids = self.grid_thw.new_zeros(len(counts), most_images, 3)
        image = patch = 0
        for r, (n_images, n_patches) in enumerate(counts):
            pixels[r, :n_patches] = self.pixel_values[patch : patch + n_patches]
            grids[r, :n_images] = self.grid_thw[image : image + n_images]
            image, patch = image + n_images, patch + n_patches
        out = {"image_pixels": pixels, "image_grids": grids, "image_rows": self.rows}
        if self.positions is not None:
            out["image_positions"] = _rows_first(self.positions)
        return out

    @classmethod
    def from_rows(cls, fields: dict[str, torch.Tensor | None]) -> ImageInputs | None:
        """`as_rows`' tensors (of a chunk of the rows) back as the chunk's images, popped from `fields`;
        None where the chunk has none."""
        pixels, grids, rows = (fields.pop(k, None) for k in ("image_pixels", "image_grids", "image_rows"))
        positions = fields.pop("image_positions", None)
        if rows is None:
            return None
        counts = rows.tolist()
        if not any(n_images for n_images, _ in counts):
            return None  # text rows: their plain positions turn as M-RoPE's would
        return cls(
            torch.cat([pixels[r, :n] for r, (_, n) in enumerate(counts)]),
            torch.cat([grids[r, :n] for r, (n, _) in enumerate(counts)]),
            positions=None if positions is None else _rows_first(positions),
            rows=rows,
        )

    @classmethod
    def encoded(
        cls, embeddings: torch.Tensor, positions: torch.Tensor | None, slots: torch.Tensor
    ) -> ImageInputs:
        """A step's images as the engine passes them (already encoded)."""
        none = torch.zeros(0, dtype=torch.long, device=embeddings.device)
        return cls(none, none.view(0, 3), embeddings, positions, slots)


def _rows_first(positions: torch.Tensor) -> torch.Tensor:
    """M-RoPE's [3, b, s] positions as [b, 3, s] and back; plain [b, s] ones as they are."""
    return positions.transpose(0, 1) if positions.dim() == 3 else positions


class Tiling(Protocol):
    """How a family cuts an image into tiles of its tower's size (LLaVA-NeXT's any-resolution grid), and
    how many image tokens that makes (picklable: data workers take it)."""

    tile_patches: int  # the tower's patches per tile

    def tiles(self, height: int, width: int) -> int: ...

    def tokens(self, height: int, width: int) -> int: ...


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
    tiling: Tiling | None = None  # images cut into tiles: each one's grid is (tiles, height, width) in pixels

    def tokens(self, grid: tuple[int, int, int]) -> int:
        """Image tokens of an image whose (t, h, w) patch grid is `grid`."""
        t, h, w = grid
        if self.tiling is not None:
            return self.tiling.tokens(h, w)
        if self.fixed:
            return self.fixed
        return t * h * w // (self.merge * self.merge)

    def patches(self, grid: tuple[int, int, int]) -> int:
        """The tower's patches of an image (its work): the patch grid's, or its tiles'."""
        t, h, w = grid
        return t * self.tiling.tile_patches if self.tiling is not None else t * h * w

    def text(self, grid: tuple[int, int, int]) -> str:
        return self.before + self.token * self.tokens(grid) + self.after


def prompt_tokens(tokenizer: Any, ids: tuple[int, ...], what: str) -> list[str]:
    """The tokenizer's tokens of a family's image-prompt ids (`what` names them, as config.json does), or
    an error where the tokenizer lacks them (another model's tokenizer)."""
    tokens = tokenizer.convert_ids_to_tokens(list(ids))
    if any(t is None for t in tokens) or max(ids) >= len(tokenizer):
        raise ModelError(f"the tokenizer has no tokens {list(ids)} ({what}): use the model's own tokenizer")
    return tokens
