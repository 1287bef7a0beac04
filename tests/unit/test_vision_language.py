"""Qwen2-VL on our decoder against transformers' own model: M-RoPE positions equal get_rope_index's, logits
equal Qwen2VLForConditionalGeneration's (fp32, 1e-4) with 0, 1 and 2 images of different sizes per sample,
and the checkpoint loads and exports as transformers reads it."""

from __future__ import annotations

import pytest
import torch

from shardforge.models.common.images import ImageInputs
from tests.vision import VISION_TOKENS, random_image, tiny_qwen2_vl

# (height, width) of each sample's images: none, one, two of different sizes (and orientations)
SAMPLES = [(), ((56, 84),), ((112, 56), (60, 90))]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tiny_qwen2_vl(tmp_path_factory.mktemp("qwen2_vl"))


@pytest.fixture(scope="module")
def reference(folder):
    from transformers import Qwen2VLForConditionalGeneration

    return Qwen2VLForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()


def encode(folder, sizes, seed=0):
    """Token ids with each image's placeholder expanded to its tokens, its ImageInputs (or None) and the
    token types transformers' forward takes."""
    from transformers import AutoImageProcessor, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    start, end, pad, _ = VISION_TOKENS
    images = [random_image(h, w, seed + i) for i, (h, w) in enumerate(sizes)]
    text = "Describe" + "".join(f" image {i}: {start}{pad}{end}" for i in range(len(images))) + " briefly."
    images_in = None
    if images:
        processed = AutoImageProcessor.from_pretrained(folder)(images=images, return_tensors="pt")
        grids = processed["image_grid_thw"]
        for grid in grids.tolist():  # one placeholder at a time, in order
            text = text.replace(pad, "\0" * (grid[0] * grid[1] * grid[2] // 4), 1)
        text = text.replace("\0", pad)
        images_in = ImageInputs(processed["pixel_values"], grids)
    ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
    types = (ids == tokenizer.convert_tokens_to_ids(pad)).int()
    return ids, images_in, types


@pytest.mark.parametrize("sizes", SAMPLES, ids=["no-image", "one-image", "two-images"])
def test_logits_equal_transformers(folder, reference, sizes):
    from shardforge.models import load_model

    ids, images, types = encode(folder, sizes)
    ours = load_model(folder).eval()
    kwargs = {}
    if images is not None:
        kwargs = {"pixel_values": images.pixel_values, "image_grid_thw": images.grid_thw}
    with torch.no_grad():
        expected = reference(input_ids=ids, mm_token_type_ids=types, **kwargs).logits
        got = ours(ids, images=images)
    assert (types.sum() > 0) == bool(sizes)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


def test_positions_equal_transformers_rope_index(folder, reference):
    from shardforge.models.qwen2_vl.rope import rope_index

    ids, images, types = encode(folder, SAMPLES[2])
    expected, _ = reference.model.get_rope_index(ids, types, image_grid_thw=images.grid_thw)
    pad = reference.config.image_token_id
    assert torch.equal(rope_index(ids, pad, images.grid_thw, 2), expected)


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_export_is_a_folder_transformers_loads(tmp_path, tie):
    """Ours written back as an HF folder: transformers' class loads it whole (no missing or unexpected
    keys) and gives our logits; the folder's config is the family's own."""
    from transformers import AutoTokenizer, Qwen2VLForConditionalGeneration

    from shardforge.models import load_model, save_model

    source = tiny_qwen2_vl(tmp_path / "in", tie=tie)
    ours = load_model(source).eval()
    assert ours.config.tie_embeddings is tie
    out = save_model(ours, tmp_path / "out", AutoTokenizer.from_pretrained(source))
    back, info = Qwen2VLForConditionalGeneration.from_pretrained(out, output_loading_info=True)
    assert not any(info.values()), info
    ids, images, types = encode(source, SAMPLES[2])
    with torch.no_grad():
        expected = back.eval()(
            input_ids=ids, mm_token_type_ids=types, pixel_values=images.pixel_values,
            image_grid_thw=images.grid_thw,
        ).logits  # fmt: skip
        torch.testing.assert_close(ours(ids, images=images), expected, atol=1e-4, rtol=0)
    assert back.config.image_token_id == ours.config.image_token_id
    assert back.config.text_config.rope_parameters["mrope_section"] == [2, 3, 3]
