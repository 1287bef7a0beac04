"""The generic backend's config: transformers' own config of the family, plus the shape fields the planner,
the cost model and the loop read (named as the Llama family's `DecoderConfig` names them, so one shape
vocabulary serves every backend)."""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace
from typing import Any, ClassVar

from transformers import PretrainedConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING

from shardforge.errors import ModelError
from shardforge.models.common.config import DecoderConfig
from shardforge.models.common.images import ImagePrompt, prompt_tokens

PREFIX = "hf:"  # a generic model's family name: "hf:<model_type>" (spec_for resolves it to the generic spec)


@dataclass
class GenericConfig(DecoderConfig):
    """`hf` builds the model (transformers' modules); the rest is read from it for planning and logs."""

    hf: Any = None  # transformers' PretrainedConfig of the family
    image_token_id: int = -1  # a vision-language family's (Gemma3VisionConfig)

    @property
    def model_type(self) -> str:
        return model_type_of(self.family)

    def with_score_head(self, num_labels: int) -> GenericConfig:
        """A reward model: transformers' ...ForSequenceClassification of the family, `num_labels` outputs."""
        hf = copy.deepcopy(self.hf)
        hf.num_labels, hf.tie_word_embeddings = num_labels, False
        hf.architectures = [MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING[type(hf)].__name__]
        return replace(self, num_labels=num_labels, tie_embeddings=False, hf=hf)


@dataclass
class Gemma3VisionConfig(GenericConfig):
    """Gemma 3 with images (transformers' Gemma3ForConditionalGeneration): its SigLIP tower and projector
    pool each image into `mm_tokens_per_image` tokens, which attend to each other both ways."""

    takes_images: ClassVar[bool] = True
    packs_images: ClassVar[bool] = False  # transformers' image masks over packed documents: not verified

    @property
    def tokens_per_image(self) -> int:
        return int(self.hf.mm_tokens_per_image)

    def planned_patches(self, max_pixels: int) -> int:
        """Every image is resized to the tower's size: its patches whatever the image's."""
        vision = self.hf.vision_config
        return (vision.image_size // vision.patch_size) ** 2

    def part_of(self, name: str) -> str:
        """The tower's pooling head (where the checkpoint has one) never reaches the features: unused."""
        if name.startswith("vision_tower.head."):
            return "unused"
        if name.startswith("vision_tower."):
            return "tower"
        return "projector" if name.startswith("multi_modal_projector.") else "language"

    def image_prompt(self, tokenizer: Any) -> ImagePrompt:
        """Gemma 3's processor's `full_image_sequence`: "\n\n<start_of_image>", its image tokens,
        "<end_of_image>\n\n"."""
        ids = (self.hf.boi_token_index, self.image_token_id, self.hf.eoi_token_index)
        what = "config.json's boi_token_index, image_token_index, eoi_token_index"
        boi, image, eoi = prompt_tokens(tokenizer, ids, what)
        patch = int(self.hf.vision_config.patch_size)
        return ImagePrompt(
            self.image_token_id, image, f"\n\n{boi}", f"{eoi}\n\n", fixed=self.tokens_per_image, patch=patch
        )


# Vision-language families the generic backend runs with their images (by model_type)
VISION: dict[str, type[GenericConfig]] = {"gemma3": Gemma3VisionConfig}


def model_type_of(family: str) -> str:
    """transformers' model_type of a family name, native (`qwen3_moe`) or generic (`hf:gemma2`)."""
    return family.removeprefix(PREFIX)


def config_from_hf(hf: PretrainedConfig) -> GenericConfig:
    """The shape fields from transformers' config (attribute names vary little across causal LMs; a missing
    one falls back as transformers' Llama does: kv heads = heads, head_dim = hidden / heads). A config with
    no such shape (a state-space or recurrent model: no attention heads; per-layer shapes; a composite
    config) is refused by its model_type."""
    try:
        text = hf.get_text_config() if hasattr(hf, "get_text_config") else hf
        heads = text.num_attention_heads
        kv = getattr(text, "num_key_value_heads", None) or heads
        ffn = getattr(text, "intermediate_size", None) or 4 * text.hidden_size
        vision = VISION.get(hf.model_type)
        return (GenericConfig if vision is None else vision)(
            vocab_size=text.vocab_size,
            hidden_size=text.hidden_size,
            intermediate_size=max(ffn) if isinstance(ffn, (list, tuple)) else ffn,  # per layer: Gemma 3n
            num_layers=text.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=kv,
            head_dim=getattr(text, "head_dim", None) or text.hidden_size // heads,
            max_position=getattr(text, "max_position_embeddings", None) or 2048,
            tie_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            sliding_window=getattr(text, "sliding_window", None),
            family=PREFIX + hf.model_type,
            num_labels=hf.num_labels if _classifies(hf) else 0,
            hf=hf,
            image_token_id=getattr(hf, "image_token_id", None) or -1,
        )
    except (AttributeError, TypeError, ValueError, KeyError, RuntimeError) as e:  # RuntimeError: per-layer
        raise ModelError(
            f"model_type {hf.model_type!r}: the generic backend reads one decoder stack's shape (attention "
            f"heads, hidden size, layers) from the config, and this family's has none it can read ({e}): "
            "state-space and recurrent models and per-layer shapes are not supported"
        ) from None


def _classifies(hf: PretrainedConfig) -> bool:
    """A folder saved as a sequence classifier (a reward model's export)."""
    return any(a.endswith("ForSequenceClassification") for a in (getattr(hf, "architectures", None) or []))


def hf_config_from(cfg: GenericConfig) -> PretrainedConfig:
    """The config written back on export: the family's own, unchanged."""
    return cfg.hf
