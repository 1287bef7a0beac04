"""Vision-language families on our decoder against transformers' own models (Qwen2-VL, Qwen2.5-VL, LLaVA):
logits equal theirs (fp32, 1e-4) with 0, 1 and 2 images of different sizes per sample, Qwen2-VL's M-RoPE
positions equal get_rope_index's, and the checkpoint loads and exports as transformers reads it."""

from __future__ import annotations

import json
from functools import partial

import numpy as np
import pytest
import torch

from shardforge.models.common.images import ImageInputs
from tests.vision import random_image, tiny_gemma3, tiny_llava, tiny_llava_next, tiny_qwen2_vl, tiny_qwen3_vl

# (height, width) of each sample's images: none, one, two of different sizes (and orientations)
SAMPLES = [(), ((56, 84),), ((112, 56), (60, 90))]
FAMILIES = {
    "gemma3": tiny_gemma3,  # on the generic backend: transformers' whole model
    "qwen2_vl": tiny_qwen2_vl,
    "qwen2_5_vl": partial(tiny_qwen2_vl, kind="qwen2_5_vl"),
    "qwen3_vl": tiny_qwen3_vl,
    "llava": tiny_llava,
    "llava_next": tiny_llava_next,
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def folder(request, tmp_path_factory):
    return FAMILIES[request.param](tmp_path_factory.mktemp(request.param))


def reference_model(folder):
    import transformers
    from transformers import AutoConfig

    architecture = AutoConfig.from_pretrained(folder).architectures[0]
    cls = getattr(transformers, architecture)
    return cls.from_pretrained(folder, dtype=torch.float32).eval()


def reference_inputs(reference, ids, kwargs):
    """`kwargs` as the reference family's forward takes them: Qwen-VL's `mm_token_type_ids`, Gemma 3's
    `token_type_ids` (its image tokens attend to each other both ways, as in its training and prefill),
    LLaVA's neither."""
    kwargs = {k: v for k, v in kwargs.items() if k != "mm_token_type_ids"}
    marks = ids == reference.config.image_token_id
    if reference.config.model_type.startswith("qwen"):
        kwargs["mm_token_type_ids"] = marks.int()
    if reference.config.model_type == "gemma3":
        kwargs["token_type_ids"] = marks.long()
    return kwargs


def encode(folder, sizes, seed=0):
    """Token ids with each image's prompt (the family's: its tokens, one per image embedding), the images
    as our forward takes them, and the keyword arguments transformers' forward takes for the same."""
    from transformers import AutoImageProcessor, AutoTokenizer

    from shardforge.config.schema import ModelSection
    from shardforge.models.build import check_model_source

    tokenizer = AutoTokenizer.from_pretrained(folder)
    prompt = check_model_source(ModelSection(path=str(folder))).image_prompt(tokenizer)
    images = [random_image(h, w, seed + i) for i, (h, w) in enumerate(sizes)]
    text = "Describe" + "".join(f" image {i}: \0" for i in range(len(images))) + " briefly."
    ours, theirs = None, {}
    if images:
        out = AutoImageProcessor.from_pretrained(folder)(images=images, return_tensors="pt")
        pixels = out["pixel_values"]
        if "image_grid_thw" in out:  # Qwen2-VL: patches and their grids
            grids = out["image_grid_thw"]
            ours = ImageInputs(pixels, grids)
            theirs = {"pixel_values": pixels, "image_grid_thw": grids}
        elif "image_sizes" in out:  # LLaVA-NeXT: each image's tiles (padded to the most), and its size
            sizes = out["image_sizes"]
            tiles = [prompt.tiling.tiles(h, w) for h, w in sizes.tolist()]
            grids = torch.tensor([[n, h, w] for n, (h, w) in zip(tiles, sizes.tolist(), strict=True)])
            ours = ImageInputs(
                torch.cat([p[:n].flatten(1) for p, n in zip(pixels, tiles, strict=True)]), grids
            )
            theirs = {"pixel_values": pixels, "image_sizes": sizes}
        else:  # LLaVA: whole resized images
            grids = torch.tensor([[1, pixels.shape[-2] // 14, pixels.shape[-1] // 14]] * len(images))
            ours = ImageInputs(pixels.flatten(1), grids)
            theirs = {"pixel_values": pixels}
        for grid in grids.tolist():
            text = text.replace("\0", prompt.text(tuple(grid)), 1)
    ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
    if "image_grid_thw" in theirs or not images:
        theirs["mm_token_type_ids"] = (ids == prompt.token_id).int()
    return ids, ours, theirs


@pytest.mark.parametrize("sizes", SAMPLES, ids=["no-image", "one-image", "two-images"])
def test_logits_equal_transformers(folder, sizes):
    from shardforge.models import load_model

    ids, images, kwargs = encode(folder, sizes)
    reference = reference_model(folder)
    kwargs = reference_inputs(reference, ids, kwargs)
    ours = load_model(folder).eval()
    with torch.no_grad():
        expected = reference(input_ids=ids, **kwargs).logits
        got = ours(ids, images=images)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


def test_qwen2_vl_positions_equal_transformers_rope_index(tmp_path):
    from shardforge.models.qwen2_vl.rope import rope_index

    folder = tiny_qwen2_vl(tmp_path)
    ids, images, kwargs = encode(folder, SAMPLES[2])
    reference = reference_model(folder)
    expected, _ = reference.model.get_rope_index(
        ids, kwargs["mm_token_type_ids"], image_grid_thw=images.grid_thw
    )
    pad = reference.config.image_token_id
    assert torch.equal(rope_index(ids, pad, images.grid_thw, 2), expected)


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_qwen2_vl_export_is_a_folder_transformers_loads(tmp_path, tie):
    """Ours written back as an HF folder: transformers' class loads it whole (no missing or unexpected
    keys) and gives our logits; the folder's config is the family's own."""
    _exports_exactly(tmp_path, tiny_qwen2_vl(tmp_path / "in", tie=tie))


@pytest.mark.parametrize(
    "make",
    [tiny_llava, tiny_llava_next, tiny_qwen3_vl, tiny_gemma3],
    ids=["llava", "llava_next", "qwen3_vl", "gemma3"],
)
def test_llava_qwen3_vl_and_gemma3_exports_are_folders_transformers_loads(tmp_path, make):
    _exports_exactly(tmp_path, make(tmp_path / "in"))


def test_gemma3_image_tokens_attend_to_each_other_both_ways_as_in_transformers(tmp_path):
    """Gemma 3 (the generic backend) marks its image tokens for transformers' masks: an image's tokens
    attend to each other both ways, as transformers' training and prefill with token_type_ids do; without
    the marks its logits would be another (causal) model's."""
    from shardforge.models import load_model

    folder = tiny_gemma3(tmp_path)
    ids, images, kwargs = encode(folder, SAMPLES[2])
    reference = reference_model(folder)
    with torch.no_grad():
        ours = load_model(folder).eval()(ids, images=images)
        both_ways = reference(input_ids=ids, **reference_inputs(reference, ids, kwargs)).logits
        causal = reference(input_ids=ids, pixel_values=kwargs["pixel_values"]).logits
    torch.testing.assert_close(ours, both_ways, atol=1e-5, rtol=0)
    assert (ours - causal).abs().max() > 1e-2


def test_llava_next_image_tokens_are_transformers_processor_s(tmp_path):
    """How many tokens an image of any size becomes (its tiles' feature map unpadded, a newline per row,
    the whole image's features) equals transformers' LlavaNextProcessor's count, which LLaMA-Factory's
    LLaVA-NeXT plugin uses too, over sizes of every aspect; and the tiles its image processor makes."""
    from transformers import AutoImageProcessor, AutoTokenizer, LlavaNextProcessor

    from shardforge.config.schema import ModelSection
    from shardforge.models.build import check_model_source

    folder = tiny_llava_next(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    image_processor = AutoImageProcessor.from_pretrained(folder)
    processor = LlavaNextProcessor(
        image_processor,
        tokenizer,
        patch_size=14,
        image_token="<image>",
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
    )  # the class token, as checkpoints set it
    tiling = check_model_source(ModelSection(path=str(folder))).image_prompt(tokenizer).tiling
    rng = np.random.default_rng(0)
    sizes = [(28, 28), (29, 300), (300, 29), (57, 85), (100, 100), (33, 47)]
    sizes += [tuple(int(v) for v in rng.integers(8, 400, 2)) for _ in range(40)]
    for h, w in sizes:
        expected = processor._get_number_of_features(h, w, 28, 28) - 1  # less the class token ("default")
        assert tiling.tokens(h, w) == expected, (h, w)
    for h, w in sizes[:6]:
        out = image_processor(images=[random_image(h, w)], return_tensors="np")
        assert out["pixel_values"].shape[1] == tiling.tiles(h, w), (h, w)


def _exports_exactly(tmp_path, source):
    from transformers import AutoTokenizer

    from shardforge.models import load_model, save_model

    ours = load_model(source).eval()
    out = save_model(ours, tmp_path / "out", AutoTokenizer.from_pretrained(source))
    cls = type(reference_model(source))
    back, info = cls.from_pretrained(out, output_loading_info=True)
    assert not any(info.values()), info
    ids, images, kwargs = encode(source, SAMPLES[2])
    kwargs = reference_inputs(back, ids, kwargs)
    with torch.no_grad():
        expected = back.eval()(input_ids=ids, **kwargs).logits
        torch.testing.assert_close(ours(ids, images=images), expected, atol=1e-4, rtol=0)
    assert back.config.image_token_id == ours.config.image_token_id
    assert (out / "preprocessor_config.json").is_file()
    source_config = json.loads((source / "config.json").read_text())
    np.testing.assert_array_equal(
        np.asarray(back.config.architectures), np.asarray(source_config["architectures"])
    )


def test_text_rows_run_the_trained_tower_on_a_blank_image_counted_zero_times(folder):
    """A training micro-batch with no image still runs the tower (on the family's blank image): its
    logits are the text model's exactly, and every tower and projector parameter gets a gradient, zeros,
    so that data-parallel ranks and pipeline chunks with and without images reduce alike."""
    from shardforge.models import load_model

    model = load_model(folder)
    ids, _, _ = encode(folder, ())
    with torch.no_grad():
        expected = model.eval()(ids)
    model.train()
    got = model(ids)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    got.sum().backward()
    tower = model.vision_parameters()
    parts = {n: model.config.part_of(model.canonical_name(n)) for n, _ in model.named_parameters()}
    used = [p for n, p in model.named_parameters() if parts[n] in ("tower", "projector")]
    assert used and all(p.grad is not None and not p.grad.any() for p in used)  # LLaVA's unused: frozen
    for p in tower:
        p.requires_grad_(False)
    model.zero_grad()
    model(ids).sum().backward()  # a frozen tower is not run at all
    assert all(p.grad is None for p in tower)


def test_m_rope_positions_of_packed_rows_equal_transformers_document_by_document(tmp_path):
    """rope_index (tensor ops, no loop over tokens) on random batches of packed rows: documents of text
    runs and images of random grids (some at a document's start), padding after: each
    document's positions equal transformers' get_rope_index of that document alone, and padding's are 0.
    (transformers reads a run of image tokens as one image: in prompts a vision-end token follows each.)"""
    import random

    from shardforge.models.qwen2_vl.rope import rope_index

    folder = tiny_qwen2_vl(tmp_path)
    reference = reference_model(folder)
    pad = reference.config.image_token_id
    rng = random.Random(0)
    for _ in range(40):
        rows, grids = [], []
        for _ in range(rng.randint(1, 3)):
            documents = []
            for _ in range(rng.randint(1, 3)):
                ids, own = [], []
                for _ in range(rng.randint(1, 4)):
                    if rng.random() < 0.5:
                        ids += [rng.randint(3, 50) for _ in range(rng.randint(1, 5))]
                        continue
                    for _ in range(rng.randint(1, 2)):  # one image, or two with one token between
                        grid = [1, 2 * rng.randint(1, 3), 2 * rng.randint(1, 3)]
                        ids += [pad] * (grid[1] * grid[2] // 4) + [2]  # as <|vision_end|> follows
                        own.append(grid)
                documents.append((ids, own))
                grids += own
            rows.append(documents)
        width = max(sum(len(ids) for ids, _ in row) for row in rows) + 2
        tokens = torch.full((len(rows), width), 1)
        positions = torch.zeros(len(rows), width, dtype=torch.long)
        expected = torch.zeros(3, len(rows), width, dtype=torch.long)
        for r, row in enumerate(rows):
            col = 0
            for ids, own in row:
                doc = torch.tensor([ids])
                tokens[r, col : col + len(ids)] = doc[0]
                positions[r, col : col + len(ids)] = torch.arange(len(ids))
                alone, _ = reference.model.get_rope_index(
                    doc, (doc == pad).int(), image_grid_thw=torch.tensor(own).view(-1, 3)
                )
                expected[:, r, col : col + len(ids)] = alone[:, 0]
                col += len(ids)
        got = rope_index(tokens, pad, torch.tensor(grids).view(-1, 3), 2, positions)
        assert torch.equal(got, expected)


def test_qwen3_vl_s_first_pipeline_stage_must_hold_its_deepstack_layers(tmp_path):
    """The deepstack features are made where the tower runs (the first stage) and join the outputs of
    decoder layers 0 and 1: a first stage without both is refused when the stages are cut, by name."""
    from shardforge.errors import ModelError
    from shardforge.models import load_model

    model = load_model(tiny_qwen3_vl(tmp_path))
    with pytest.raises(ModelError, match=r"layers 0-1: the first pipeline stage must hold them"):
        model.part([0], first=True, last=False)
    model.part([0, 1], first=True, last=False)
    model.part([2], first=False, last=True)
    with pytest.raises(ModelError, match=r"parallel\.pp_layers"):
        model.prune([0], first=True, last=False)
