"""LLaVA-NeXT (1.6): LLaVA's tower and projector before our decoder, with images of any resolution. An image
is resized onto the best of the checkpoint's grid resolutions (`image_grid_pinpoints`) and cut into tiles of
the tower's size, plus the whole image shrunk to one tile; the tower sees every tile. The whole image's
features come first, then the tiles' laid back out as one feature map, the padding the resize added cut
off, and a learned `image_newline` embedding after each row of it. How many tokens that makes depends on
the image's size: the data's prompt and the model count it alike (`AnyResGrid`), as transformers'
LlavaNextProcessor and LlavaNextModel do."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from shardforge.errors import ModelError
from shardforge.models.common.images import ImageInputs, ImagePrompt
from shardforge.models.llava.model import LlavaConfig, LlavaDecoder, tower_and_projector

NEWLINE = "anyres.image_newline"  # where we hold transformers' `image_newline`


@dataclass(frozen=True)
class AnyResGrid:
    """LLaVA-NeXT's tiling of an image of a given size (models/common/images.py: Tiling)."""

    pinpoints: tuple[tuple[int, int], ...]  # the resolutions (height, width) an image may be resized onto
    tile: int  # pixels per tile side (the tower's image size)
    patch: int  # pixels per patch side

    @property
    def side(self) -> int:
        return self.tile // self.patch

    @property
    def tile_patches(self) -> int:
        return self.side * self.side

    def layout(self, height: int, width: int) -> tuple[int, int]:
        """Tiles down and across of the best resolution for an image of this size."""
        from transformers.image_processing_utils import select_best_resolution

        best_height, best_width = select_best_resolution([height, width], [list(p) for p in self.pinpoints])
        return best_height // self.tile, best_width // self.tile

    def tiles(self, height: int, width: int) -> int:
        down, across = self.layout(height, width)
        return down * across + 1  # and the whole image

    def unpadded(self, height: int, width: int) -> tuple[int, int]:
        """The tiles' feature map (rows, columns) once the resize's padding is cut off (transformers'
        unpad_image: the padding is split evenly, a remainder cut as whole rows from both sides)."""
        down, across = self.layout(height, width)
        rows, cols = down * self.side, across * self.side
        if width / height > cols / rows:
            pad = (rows - int(round(height * (cols / width), 7))) // 2
            return rows - 2 * pad, cols
        pad = (cols - int(round(width * (rows / height), 7))) // 2
        return rows, cols - 2 * pad

    def tokens(self, height: int, width: int) -> int:
        rows, cols = self.unpadded(height, width)
        return self.tile_patches + rows * (cols + 1)  # the whole image's, then each row and its newline


@dataclass
class LlavaNextConfig(LlavaConfig):
    grid_pinpoints: tuple[tuple[int, int], ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.select != "default":
            raise ModelError(
                f"LLaVA-NeXT with vision_feature_select_strategy={self.select!r} is not supported (its "
                f"tiles' features are laid out without the class token: 'default')"
            )

    @property
    def grid(self) -> AnyResGrid:
        return AnyResGrid(self.grid_pinpoints, int(self.vision["image_size"]), int(self.vision["patch_size"]))

    def planned_patches(self, max_pixels: int) -> int:
        """A square image of `max_pixels`: its tiles' patches and class tokens."""
        side = int(max_pixels**0.5)
        return self.grid.tiles(side, side) * (self.grid.tile_patches + 1)

    def part_of(self, name: str) -> str:
        """As LLaVA's; the newline embedding is a part of its own, which no method.vision switch freezes
        (LLaMA-Factory's name none of it: full tuning trains it whatever they say)."""
        return "newline" if name == NEWLINE else super().part_of(name)

    def image_prompt(self, tokenizer: Any) -> ImagePrompt:
        base = super().image_prompt(tokenizer)
        return ImagePrompt(base.token_id, base.token, patch=base.patch, tiling=self.grid)


class AnyRes(nn.Module):
    """Lays each image's tile features out as LLaVA-NeXT does and holds its `image_newline`: a module, so
    that tensor parallel replicates it with the tower (its code then sees the local tensor)."""

    def __init__(self, cfg: LlavaNextConfig) -> None:
        super().__init__()
        self.grid = cfg.grid
        self.image_newline = nn.Parameter(torch.zeros(cfg.hidden_size))

    def forward(self, features: torch.Tensor, grids: torch.Tensor) -> torch.Tensor:
        """[tiles, patches per tile, hidden] of every image in order, their (tiles, height, width) grids ->
        [image tokens, hidden]."""
        side, out, start = self.grid.side, [], 0
        newline = self.image_newline.to(features.dtype)
        for tiles, height, width in grids.tolist():
            image = features[start : start + tiles]
            start += tiles
            down, across = self.grid.layout(height, width)
            if down * across + 1 != tiles:
                raise ModelError(f"an image of {height}x{width} pixels has {tiles} tiles; its grid makes it "
                                 f"{down * across + 1}")  # fmt: skip
            rows, cols = self.grid.unpadded(height, width)
            tiled = image[1:].view(down, across, side, side, -1).permute(0, 2, 1, 3, 4)
            tiled = tiled.reshape(down * side, across * side, -1)
            top, left = (down * side - rows) // 2, (across * side - cols) // 2
            tiled = tiled[top : top + rows, left : left + cols]
            tiled = torch.cat([tiled, newline.expand(rows, 1, -1)], dim=1).flatten(0, 1)
            out += [image[0], tiled]
        return torch.cat(out)


class LlavaNextDecoder(LlavaDecoder):
    """Token ids and images (tiles) -> logits."""

    TOWERS = ("vision_tower", "multi_modal_projector", "anyres")

    @staticmethod
    def vision_modules(cfg: LlavaNextConfig) -> dict[str, nn.Module]:
        from transformers import LlavaNextConfig as HFLlavaNextConfig
        from transformers.models.llava_next.modeling_llava_next import LlavaNextMultiModalProjector

        hf = HFLlavaNextConfig.from_dict(cfg.hf_config)
        return {**tower_and_projector(hf, LlavaNextMultiModalProjector), "anyres": AnyRes(cfg)}

    def blank_image(self) -> ImageInputs:
        """An image of one tile's size, in the tiles the grid cuts it into."""
        side = int(self.config.vision["image_size"])
        tiles = self.config.grid.tiles(side, side)
        return ImageInputs(torch.zeros(tiles, 3 * side * side), torch.tensor([[tiles, side, side]]))

    def image_embeddings(self, images: ImageInputs, dtype: torch.dtype) -> torch.Tensor:
        cfg = self.config
        side = int(cfg.vision["image_size"])
        features = self.tower_features(images.pixel_values.view(-1, 3, side, side))
        return self.anyres(self.multi_modal_projector(features), images.grid_thw).to(dtype)
