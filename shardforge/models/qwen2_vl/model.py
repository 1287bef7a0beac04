"""Qwen2-VL: transformers' own vision tower (its ViT and patch merger, as the family defines them) in front of
our Llama-family decoder, whose image-placeholder tokens take the tower's embeddings and whose rotary
embedding is the multimodal one (rope.py). The decoder is the `Decoder` every layout, adapter and the
inference engine already take: the tower is one more submodule beside its layers."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn

from shardforge.errors import ModelError
from shardforge.models.common.config import DecoderConfig
from shardforge.models.common.images import ImageInputs, ImagePrompt, prompt_tokens
from shardforge.models.llama.vision import VisionLanguageDecoder
from shardforge.models.qwen2_vl.rope import mrope_cos_sin, rope_index


@dataclass
class VisionLanguageConfig(DecoderConfig):
    """The decoder's shape plus what joins the tower to it: the image placeholder token, the M-RoPE
    sections (halves of the head dimension per position component) and the tower's transformers config."""

    image_token_id: int = -1
    vision_start_token_id: int = -1
    vision_end_token_id: int = -1
    mrope_section: tuple[int, ...] = ()
    mrope_interleaved: bool = False  # Qwen3-VL: frequencies take t, h, w in turn (rope.py)
    deepstack: int = 0  # Qwen3-VL: the tower's feature maps added to the first decoder layers' outputs
    vision: dict = field(default_factory=dict)  # config.json's vision_config
    takes_images: ClassVar[bool] = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if sum(self.mrope_section) != self.head_dim // 2 and not self.mrope_interleaved:
            raise ModelError(
                f"rope_parameters.mrope_section {list(self.mrope_section)} sums to "
                f"{sum(self.mrope_section)}; "
                f"it must cover head_dim / 2 = {self.head_dim // 2} frequencies"
            )

    @property
    def deepstack_layers(self) -> int:
        return self.deepstack

    @property
    def tower_dims(self) -> tuple[int, int, int]:
        """The tower's (layers, width, MLP width): Qwen2-VL's embed_dim and mlp_ratio, or the sizes."""
        v = self.vision
        width = int(v.get("embed_dim") or v["hidden_size"])
        inner = int(v.get("intermediate_size") or width * float(v.get("mlp_ratio", 4)))
        return int(v["depth"]), width, inner

    def planned_patches(self, max_pixels: int) -> int:
        """A square image of `max_pixels`, cut to whole merged tokens (the processor's resize)."""
        side = int(self.vision["patch_size"]) * self.merge
        tokens = max(1, int(max_pixels**0.5) // side)
        return (tokens * self.merge) ** 2

    @property
    def merge(self) -> int:
        """Patches per image token along each side (the patch merger's)."""
        return int(self.vision.get("spatial_merge_size", 2))

    def part_of(self, name: str) -> str:
        if name.startswith("visual.merger."):  # Qwen3-VL's deepstack mergers: the tower's, as for LF
            return "projector"
        return "tower" if name.startswith("visual.") else "language"

    def image_prompt(self, tokenizer: Any) -> ImagePrompt:
        """What an image becomes in a prompt, in this tokenizer's tokens."""
        ids = (self.image_token_id, self.vision_start_token_id, self.vision_end_token_id)
        token, before, after = prompt_tokens(
            tokenizer, ids, "config.json's image, vision start and end tokens"
        )
        return ImagePrompt(self.image_token_id, token, before, after, self.merge, min_side=28, max_aspect=200)


# model_type -> transformers' module of the family and its vision config and tower classes
TOWER_CLASSES = {
    "qwen2_vl": ("qwen2_vl", "Qwen2VLVisionConfig", "Qwen2VisionTransformerPretrainedModel"),
    "qwen2_5_vl": ("qwen2_5_vl", "Qwen2_5_VLVisionConfig", "Qwen2_5_VisionTransformerPretrainedModel"),
    "qwen3_vl": ("qwen3_vl", "Qwen3VLVisionConfig", "Qwen3VLVisionModel"),
}


def vision_tower(cfg: VisionLanguageConfig) -> nn.Module:
    """transformers' vision transformer of the family (Qwen2-VL's; Qwen2.5-VL's, with windowed attention)
    for the checkpoint's vision_config."""
    import importlib

    module, config_cls, tower_cls = TOWER_CLASSES[cfg.family]
    configs = importlib.import_module(f"transformers.models.{module}.configuration_{module}")
    models = importlib.import_module(f"transformers.models.{module}.modeling_{module}")
    config = getattr(configs, config_cls)(**{k: v for k, v in cfg.vision.items() if k != "model_type"})
    config._attn_implementation = "sdpa"
    return getattr(models, tower_cls)._from_config(config)


class Qwen2VLDecoder(VisionLanguageDecoder):
    """Token ids and images -> logits. The images' merged patch embeddings replace the embeddings of the
    image tokens (in order); positions are M-RoPE's [3, b, s] where a batch has images (rows of plain text
    take the usual [b, s], which M-RoPE turns exactly as RoPE)."""

    TOWERS = ("visual",)

    @staticmethod
    def vision_modules(cfg: VisionLanguageConfig) -> dict[str, nn.Module]:
        return {"visual": vision_tower(cfg)}

    def reset_buffers(self) -> None:
        super().reset_buffers()
        if self.visual is not None:  # the tower's rotary frequencies, which `to_empty` left unset
            rotary = self.visual.rotary_pos_emb
            device = self.visual.patch_embed.proj.weight.device
            self.visual.rotary_pos_emb = type(rotary)(self.visual.config).to(device)

    def image_embeddings(self, images: ImageInputs, dtype: torch.dtype) -> torch.Tensor:
        """[image tokens, hidden]: the tower's merged patches of every image, in order (Qwen3-VL: each row
        followed by its deepstack features, [image tokens, hidden x (1 + deepstack)])."""
        pixels = images.pixel_values.to(self.visual.patch_embed.proj.weight.dtype)
        out = self.visual(pixels, grid_thw=images.grid_thw)
        stacked = out.deepstack_features if self.config.deepstack else ()
        return torch.cat([out.pooler_output, *stacked], dim=-1).to(dtype)

    def blank_image(self) -> ImageInputs:
        """One image of merge x merge patches (a single image token)."""
        vision, merge = self.config.vision, self.config.merge
        patch, frames = int(vision["patch_size"]), int(vision.get("temporal_patch_size", 2))
        features = int(vision.get("in_channels", 3)) * frames * patch * patch
        return ImageInputs(torch.zeros(merge * merge, features), torch.tensor([[1, merge, merge]]))

    def rotary_positions(
        self, x: torch.Tensor, position_ids: torch.Tensor, images: ImageInputs | None
    ) -> torch.Tensor:
        """M-RoPE's [3, b, s] positions where there are images: those given (the engine's, or a pipeline's,
        made before its stages), or made from the token ids `x`, the rows' [b, s] positions (each packed
        document from 0) and the images' grids."""
        if images is None:
            return position_ids
        if images.positions is not None:
            return images.positions
        if x.is_floating_point():
            raise ModelError("M-RoPE positions need the token ids: a later pipeline stage must be given them")
        return rope_index(x, self.config.image_token_id, images.grid_thw, self.config.merge, position_ids)

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if positions.dim() == 2:
            return super().rope(positions, dtype)
        cfg = self.config
        return mrope_cos_sin(positions, self.inv_freq, cfg.mrope_section, dtype, cfg.mrope_interleaved)

    def after_block(
        self, index: int, h: torch.Tensor, x: torch.Tensor, images: ImageInputs | None
    ) -> torch.Tensor:
        """Qwen3-VL's deepstack: the tower's feature map `index` of the image tokens added to the output
        of decoder layer `index` (the first `deepstack` layers, which the first pipeline stage holds)."""
        if index >= self.config.deepstack or images is None or images.embeddings is None:
            return h
        hidden = self.config.hidden_size
        slots = x == self.config.image_token_id if images.slots is None else images.slots
        stacked = images.embeddings[:, hidden * (index + 1) : hidden * (index + 2)]
        return h.masked_scatter(slots[..., None], h[slots] + stacked.to(h.dtype))

    def prune(self, layers: list[int], first: bool, last: bool) -> None:
        self._check_deepstack(layers, first)
        super().prune(layers, first, last)

    def part(self, layers: list[int], first: bool, last: bool) -> VisionLanguageDecoder:
        self._check_deepstack(layers, first)
        return super().part(layers, first, last)

    def _check_deepstack(self, layers: list[int], first: bool) -> None:
        """The deepstack features live where the tower runs: on the first stage, with the layers they join."""
        k = self.config.deepstack
        if first and k and not set(range(k)) <= set(layers):
            raise ModelError(
                f"{self.config.family} adds the tower's deepstack features after decoder layers 0-{k - 1}: "
                f"the first pipeline stage must hold them (parallel.pp_layers), not only {sorted(layers)}"
            )
