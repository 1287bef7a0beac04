"""A vision-language family on the generic backend (Gemma 3): transformers' whole model, its tower and
projector making each image's embeddings, which take the places of the image tokens in the embedded stream;
transformers then builds the family's masks from where the image tokens are (Gemma 3's: an image's tokens
attend to each other both ways, as its training and its generation's prefill do)."""

from __future__ import annotations

from typing import Any

import torch

from shardforge.errors import ModelError
from shardforge.models.common.images import ImageInputs
from shardforge.models.generic.model import HFCausalLM


class HFVisionLM(HFCausalLM):
    """Token ids and images -> logits, by transformers' modules. The engine recomputes each sequence
    (`pages` off): the paged cache's attention cannot let an image's tokens attend both ways."""

    vision = True

    def __init__(self, cfg: Any, mlp: Any = None, pretrained: Any = None) -> None:
        super().__init__(cfg, mlp, pretrained)
        self.pages = False

    def blocks(self) -> list[torch.nn.Module]:
        """The language model's decoder layers (the tower's are not among the model's `layers`)."""
        return list(self.hf.base_model.language_model.layers)

    def _pixels(self, images: ImageInputs) -> torch.Tensor:
        """The images as the tower takes them [images, 3, side, side] (kept flat, a row per image)."""
        side = self.hf.config.vision_config.image_size
        return images.pixel_values.reshape(len(images.pixel_values), 3, side, side)

    def image_embeddings(self, images: ImageInputs, dtype: torch.dtype) -> torch.Tensor:
        """[image tokens, hidden]: every image's pooled, projected tower features, in order."""
        pixels = self._pixels(images).to(dtype)
        features = self.hf.base_model.get_image_features(pixel_values=pixels).pooler_output
        return features.reshape(-1, features.shape[-1]).to(dtype)

    def blank_image(self) -> ImageInputs:
        """The tower's input, all zeros (run where a training micro-batch has no image)."""
        vision = self.hf.config.vision_config
        side = vision.image_size // vision.patch_size
        return ImageInputs(torch.zeros(1, 3 * vision.image_size**2), torch.tensor([[1, side, side]]))

    def vision_parameters(self) -> list[torch.nn.Parameter]:
        base = self.hf.base_model
        return [*base.vision_tower.parameters(), *base.multi_modal_projector.parameters()]

    def hidden(
        self,
        x: torch.Tensor,
        position_ids: torch.Tensor | None,
        doc_ids: torch.Tensor | None = None,
        doc_layout: Any = None,
        cache: Any = None,
        images: Any = None,
    ) -> torch.Tensor:
        """transformers' body over the tokens' embeddings with the images' at their image tokens (`slots`
        where given: a completion's token that happens to be the image token is a token), the image tokens
        marked as `token_type_ids` for the family's masks."""
        if images is None:
            h = super().hidden(x, position_ids, doc_ids, doc_layout, cache)
            if self.training and any(p.requires_grad for p in self.vision_parameters()):
                # a trained tower runs on a blank image counted zero times: every data-parallel rank's
                # gradient reductions then match (models/llama/vision.py)
                blank = self.image_embeddings(self.blank_image().to(x.device), h.dtype)
                h = h + 0.0 * blank.sum()
            return h
        if cache is not None:
            raise ModelError(f"{self.config.model_type}: images are placed by the engine's recompute runner")
        if doc_layout is not None or (doc_ids is not None and bool((doc_ids > 0).any())):
            raise ModelError(
                f"{self.config.model_type}: packed rows with images are not verified on the generic backend "
                f"(transformers' image masks over packed documents): set data.packing: false"
            )
        token = self.config.image_token_id
        # transformers embeds an image token outside the text vocabulary as token 0 (replaced after)
        embedded = self.embed_tokens(x.masked_fill(x == token, 0) if token >= self.config.vocab_size else x)
        features = images.embeddings
        if features is None:
            features = self.image_embeddings(images, embedded.dtype)
        slots = x == token if images.slots is None else images.slots
        if int(slots.sum()) != features.shape[0]:
            raise ModelError(
                f"the batch has {int(slots.sum())} image tokens but its images make {features.shape[0]} "
                f"embeddings: each image's mark must be expanded to its tokens"
            )
        embedded = embedded.masked_scatter(slots[..., None], features.to(embedded.dtype))
        out = self.hf.base_model(
            inputs_embeds=embedded, position_ids=position_ids, token_type_ids=slots.long(), use_cache=False
        )
        return out.last_hidden_state


def generic_model(cfg: Any, mlp: Any = None, pretrained: Any = None) -> HFCausalLM:
    """The generic backend's model of `cfg`: with its images where the family takes them."""
    cls = HFVisionLM if cfg.takes_images else HFCausalLM
    return cls(cfg, mlp, pretrained)
