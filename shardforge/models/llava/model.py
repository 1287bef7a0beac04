"""LLaVA (1.5): transformers' own vision tower (CLIP or SigLIP, as config.json's vision_config names it) and
multi-modal projector in front of our Llama-family decoder. Each image (resized and cropped to the tower's
size by its processor) becomes the projected features of one of the tower's hidden layers
(`vision_feature_layer`; without the class token under the "default" strategy), which replace the
embeddings of that image's `<image>` tokens; positions are the decoder's own."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn

from shardforge.models.common.config import DecoderConfig
from shardforge.models.common.images import ImageInputs, ImagePrompt, prompt_tokens
from shardforge.models.llama.vision import VisionLanguageDecoder

TOWER, PROJECTOR = "vision_tower.", "multi_modal_projector."


@dataclass
class LlavaConfig(DecoderConfig):
    """The decoder's shape plus the image token and how features are taken from the tower; `hf_config` is
    the whole checkpoint config (transformers' LlavaConfig, which the projector is built from)."""

    image_token_id: int = -1
    feature_layer: int = -2
    select: str = "default"  # "default": drop the class token; "full": keep it
    vision: dict = field(default_factory=dict)  # config.json's vision_config
    takes_images: ClassVar[bool] = True

    merge = 1  # an image token per patch

    @property
    def tokens_per_image(self) -> int:
        side = int(self.vision["image_size"]) // int(self.vision["patch_size"])
        return side * side + (self.select == "full")

    @property
    def tower_dims(self) -> tuple[int, int, int]:
        """The tower's (layers that run up to the feature layer, width, MLP width)."""
        v = self.vision
        used = self.feature_layer % (int(v["num_hidden_layers"]) + 1)
        return used, int(v["hidden_size"]), int(v["intermediate_size"])

    def planned_patches(self, max_pixels: int) -> int:
        """Every image is resized to the tower's: its patches (and class token) whatever its size."""
        return self.tokens_per_image + (self.select == "default")

    def part_of(self, name: str) -> str:
        """As the decoder's; the tower's layers after the feature layer, and its final norm and pooling head,
        never reach the features: "unused" (they never train)."""
        if name.startswith(PROJECTOR):
            return "projector"
        if not name.startswith(TOWER):
            return "language"
        rest = name.removeprefix(TOWER).split(".")
        used = self.feature_layer % (int(self.vision["num_hidden_layers"]) + 1)  # hidden_states[k]: k layers
        if rest[0] in ("post_layernorm", "head") or (
            rest[:2] == ["encoder", "layers"] and int(rest[2]) >= used
        ):
            return "unused"
        return "tower"

    def image_prompt(self, tokenizer: Any) -> ImagePrompt:
        (token,) = prompt_tokens(tokenizer, (self.image_token_id,), "config.json's image_token_index")
        patch = int(self.vision["patch_size"])
        return ImagePrompt(self.image_token_id, token, fixed=self.tokens_per_image, patch=patch)


def tower_and_projector(hf: Any, projector_cls: type[nn.Module]) -> dict[str, nn.Module]:
    """transformers' vision tower of the checkpoint's config `hf` (SDPA attention) and its projector."""
    from transformers import AutoModel

    hf.vision_config._attn_implementation = "sdpa"
    return {
        "vision_tower": AutoModel.from_config(hf.vision_config),
        "multi_modal_projector": projector_cls(hf),
    }


class LlavaDecoder(VisionLanguageDecoder):
    """Token ids and images -> logits; the tower and projector are transformers' modules."""

    TOWERS = ("vision_tower", "multi_modal_projector")

    @staticmethod
    def vision_modules(cfg: LlavaConfig) -> dict[str, nn.Module]:
        from transformers import LlavaConfig as HFLlavaConfig
        from transformers.models.llava.modeling_llava import LlavaMultiModalProjector

        return tower_and_projector(HFLlavaConfig.from_dict(cfg.hf_config), LlavaMultiModalProjector)

    def reset_buffers(self) -> None:
        super().reset_buffers()
        if self.vision_tower is None:
            return
        for name, buffer in self.vision_tower.named_buffers():  # CLIP's / SigLIP's position ids
            if name.endswith("position_ids"):
                buffer.copy_(torch.arange(buffer.shape[-1], device=buffer.device).expand_as(buffer))

    def image_embeddings(self, images: ImageInputs, dtype: torch.dtype) -> torch.Tensor:
        """[images x tokens per image, hidden]: each image's projected features, in order."""
        patch = int(self.config.vision["patch_size"])
        _, h, w = (int(v) * patch for v in images.grid_thw[0].tolist())  # its grid of patches
        pixels = images.pixel_values.view(len(images.grid_thw), 3, h, w)
        return self.multi_modal_projector(self.tower_features(pixels)).flatten(0, 1).to(dtype)

    def blank_image(self) -> ImageInputs:
        side, patch = int(self.config.vision["image_size"]), int(self.config.vision["patch_size"])
        return ImageInputs(torch.zeros(1, 3 * side * side), torch.tensor([[1, side // patch, side // patch]]))

    def tower_features(self, pixels: torch.Tensor) -> torch.Tensor:
        """[images, patches, tower hidden]: the feature layer's hidden states of each image [3, h, w]
        (without the class token under the "default" strategy)."""
        weight = next(self.vision_tower.parameters())
        out = self.vision_tower(pixels.to(weight.dtype), output_hidden_states=True, return_dict=True)
        features = out.hidden_states[self.config.feature_layer]
        return features[:, 1:] if self.config.select == "default" else features
