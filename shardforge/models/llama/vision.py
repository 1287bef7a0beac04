"""What every vision-language family built on our decoder shares: its vision modules (transformers', named
in `TOWERS`) run on the first pipeline stage beside the embedding, and their image embeddings take the
places of the image tokens in the embedded stream, which is then cut as the blocks take it."""

from __future__ import annotations

from abc import abstractmethod
from typing import ClassVar

import torch
from torch import nn

from shardforge.errors import ModelError
from shardforge.models.common.images import ImageInputs
from shardforge.models.llama.model import Decoder, MLPFactory


class VisionLanguageDecoder(Decoder):
    """Token ids and images -> logits."""

    vision = True
    TOWERS: ClassVar[tuple[str, ...]] = ()  # the attributes holding the vision modules

    def __init__(self, cfg: object, mlp: MLPFactory | None = None) -> None:
        super().__init__(cfg, mlp)
        self.stream_split: nn.Module | None = nn.Identity()  # tensor parallel cuts the merged stream here

    @abstractmethod
    def image_embeddings(self, images: ImageInputs, dtype: torch.dtype) -> torch.Tensor:
        """[image tokens, hidden]: every image's embeddings, in the order of their tokens."""

    def prune(self, layers: list[int], first: bool, last: bool) -> None:
        super().prune(layers, first, last)
        if not first:
            for name in (*self.TOWERS, "stream_split"):
                setattr(self, name, None)

    def part(self, layers: list[int], first: bool, last: bool) -> VisionLanguageDecoder:
        view = super().part(layers, first, last)
        for name in (*self.TOWERS, "stream_split"):
            setattr(view, name, getattr(self, name) if first else None)
        return view

    def embed(self, x: torch.Tensor, images: ImageInputs | None) -> torch.Tensor:
        """The tokens' embeddings with the images' in place of their image tokens, whole, then the stream
        as the blocks take it (`stream_split`: tensor parallel's sequence shard)."""
        if self.embed_tokens is None:
            return super().embed(x, None)
        h = self.embed_tokens(x)
        if images is not None:
            slots = x == self.config.image_token_id if images.slots is None else images.slots
            features = images.embeddings
            features = self.image_embeddings(images, h.dtype) if features is None else features.to(h.dtype)
            if int(slots.sum()) != features.shape[0]:
                raise ModelError(
                    f"the batch has {int(slots.sum())} image tokens but its {len(images.grid_thw)} image(s) "
                    f"make {features.shape[0]} embeddings: each image's mark must be expanded to its tokens"
                )
            h = h.masked_scatter(slots[..., None], features)
        return self.stream_split(h)
