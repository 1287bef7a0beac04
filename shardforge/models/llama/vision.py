"""What every vision-language family built on our decoder shares: its vision modules (transformers', named
in `TOWERS`) run on the first pipeline stage beside the embedding, and their image embeddings take the
places of the image tokens in the embedded stream, which is then cut as the blocks take it."""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import replace
from typing import Any, ClassVar

import torch
from torch import nn

from shardforge.errors import ModelError
from shardforge.models.common.costs import costs
from shardforge.models.common.images import ImageInputs
from shardforge.models.llama.model import Decoder, MLPFactory
from shardforge.models.spec import CostModel


class VisionLanguageDecoder(Decoder):
    """Token ids and images -> logits."""

    vision = True
    TOWERS: ClassVar[tuple[str, ...]] = ()  # the attributes holding the vision modules, tower first

    def __init__(self, cfg: object, mlp: MLPFactory | None = None) -> None:
        super().__init__(cfg, mlp)
        for name, module in self.vision_modules(cfg).items():
            setattr(self, name, module)
        self.stream_split: nn.Module | None = nn.Identity()  # tensor parallel cuts the merged stream here

    @staticmethod
    @abstractmethod
    def vision_modules(cfg: object) -> dict[str, nn.Module]:
        """The family's vision modules (transformers'), by the attribute each is held at (`TOWERS`)."""

    @abstractmethod
    def image_embeddings(self, images: ImageInputs, dtype: torch.dtype) -> torch.Tensor:
        """[image tokens, hidden]: every image's embeddings, in the order of their tokens."""

    @abstractmethod
    def blank_image(self) -> ImageInputs:
        """The smallest image the tower takes, all zeros (run where a training micro-batch has none)."""

    def vision_parameters(self) -> list[nn.Parameter]:
        return [p for name in self.TOWERS if (m := getattr(self, name)) is not None for p in m.parameters()]

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

    def encode_images(self, images: ImageInputs | None) -> ImageInputs | None:
        """The images' embeddings from the tower, where this part has it and the engine has not made them
        (of the tokens it places: `keep`, under context parallel)."""
        if images is None or images.embeddings is not None or self.embed_tokens is None:
            return images
        embeddings = self.image_embeddings(images, self.embed_tokens.weight.dtype)
        return replace(images, embeddings=embeddings if images.keep is None else embeddings[images.keep])

    def embed(self, x: torch.Tensor, images: ImageInputs | None) -> torch.Tensor:
        """The tokens' embeddings with the images' in place of their image tokens, whole, then the stream
        as the blocks take it (`stream_split`: tensor parallel's sequence shard)."""
        if self.embed_tokens is None:
            return super().embed(x, None)
        h = self.embed_tokens(x)
        if images is None and self.training and any(p.requires_grad for p in self.vision_parameters()):
            # Rows without an image still run the tower, on a blank image counted zero times: every
            # data-parallel rank and pipeline chunk then gives the trained tower a gradient (zeros here),
            # and the gradient reductions (DDP's, FSDP2's reduce-scatters, in their order) match
            blank = self.image_embeddings(self.blank_image().to(x.device), h.dtype)
            return self.stream_split(h + 0.0 * blank.sum())
        if images is not None:
            slots = x == self.config.image_token_id if images.slots is None else images.slots
            # the rows' first hidden features (Qwen3-VL's carry its deepstack features after)
            features = images.embeddings[:, : h.shape[-1]].to(h.dtype)
            if int(slots.sum()) != features.shape[0]:
                raise ModelError(
                    f"the batch has {int(slots.sum())} image tokens but its {len(images.grid_thw)} image(s) "
                    f"make {features.shape[0]} embeddings: each image's mark must be expanded to its tokens"
                )
            h = h.masked_scatter(slots[..., None], features)
        return self.stream_split(h)


def vision_language_costs(model_cls: type[VisionLanguageDecoder], cfg: Any) -> CostModel:
    """The decoder's cost model, plus the vision modules' parameters and forward FLOPs per image patch: two
    per weight for every patch through the tower (all its layers run, used or not), and through the
    projector per image token, which merges merge x merge patches. Attention scores and norms are left out
    (the planner's GEMM view)."""
    base = costs(cfg)
    with torch.device("meta"):
        modules = model_cls.vision_modules(cfg)
    params = {"tower": 0, "projector": 0, "unused": 0, "newline": 0}  # newline: LLaVA-NeXT's
    for attr, module in modules.items():
        for name, p in module.named_parameters():
            params[cfg.part_of(f"{attr}.{name}")] += p.numel()
    tower, projector = params["tower"] + params["unused"], params["projector"]
    layers, hidden, inner = cfg.tower_dims
    kept = layers * (12 * hidden + 3 * inner) + 3 * hidden + 2 * cfg.hidden_size / (cfg.merge * cfg.merge)
    return replace(
        base,
        patch_activations=kept,
        params=replace(base.params, vision=tower + projector + params["newline"]),
        patch_flops=2.0 * tower + 2.0 * projector / (cfg.merge * cfg.merge),
    )
