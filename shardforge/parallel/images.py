"""A batch's images placed from its whole rows' token ids, once, before the rows are cut: a pipeline's later
stages see only the stream, and a context-parallel rank only its part of each row."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from shardforge.models.common.images import ImageInputs


def placed(model: Any, batch: Any) -> Any:
    """The batch with its images' rotary positions (a family's own, e.g. Qwen2-VL's M-RoPE, else the
    tokens') and image-token slots made from its whole rows, where not already given (RL's rollouts give
    them)."""
    images = batch.images
    if images is None:
        return batch
    positions = images.positions
    if positions is None:
        positions = model.rotary_positions(batch.input_ids, batch.position_ids, images)
    slots = images.slots if images.slots is not None else batch.input_ids == model.config.image_token_id
    return replace(batch, images=replace(images, positions=positions, slots=slots))


def local_images(images: ImageInputs, index: torch.Tensor) -> ImageInputs:
    """`placed` images as a context-parallel rank's part of each row (`index`: its sequence indices) takes
    them: its tokens' rotary positions and image slots, and which of the images' tokens (row-major) are its
    own (`keep`): the tower runs on every image of the rows; the part places its own tokens' embeddings."""
    assert images.positions is not None and images.slots is not None, "placed() first"
    mine = torch.zeros_like(images.slots)
    mine[:, index] = True
    return replace(
        images,
        positions=images.positions.index_select(-1, index),
        slots=images.slots.index_select(1, index),
        keep=mine[images.slots],
    )
