"""Adversarial checks of LLaVA-NeXT (llava_next: any-resolution tiles, the image_newline) and Qwen3-VL
(qwen3_vl: interleaved M-RoPE, the deepstack) against transformers: images of extreme sizes and aspects,
several images of different tile counts in a record and in a batch, images at a prompt's very start and end
and side by side, packed documents, prompt chunks that cut an image, a tied checkpoint, the blank image of
a text-only training micro-batch under bf16 autocast, and the dataset cache read back from disk."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from shardforge.models.common.images import ImageInputs
from tests.vision import random_image, tiny_llava_next, tiny_qwen3_vl, vision_data_config, vision_rows

NEW = 6


@pytest.fixture(scope="module")
def next_dir(tmp_path_factory):
    return tiny_llava_next(tmp_path_factory.mktemp("llava_next"))


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    return tiny_qwen3_vl(tmp_path_factory.mktemp("qwen3_vl"))


@pytest.fixture(scope="module")
def qwen3_tied_dir(tmp_path_factory):
    return tiny_qwen3_vl(tmp_path_factory.mktemp("qwen3_vl_tied"), tie=True)


@pytest.fixture(scope="module")
def references(next_dir, qwen3_dir, qwen3_tied_dir):
    from tests.unit.test_vision_language import reference_model

    return {d: reference_model(d) for d in (next_dir, qwen3_dir, qwen3_tied_dir)}


def _prompt_of(folder):
    from transformers import AutoTokenizer

    from shardforge.config.schema import ModelSection
    from shardforge.models.build import check_model_source

    tokenizer = AutoTokenizer.from_pretrained(folder)
    return tokenizer, check_model_source(ModelSection(path=str(folder))).image_prompt(tokenizer)


def _encode(folder, pieces, seed=0):
    """`pieces`: text (str) and images ((height, width)) in prompt order. Token ids [1, s], our images and
    transformers' keyword arguments for the same."""
    from transformers import AutoImageProcessor

    tokenizer, prompt = _prompt_of(folder)
    sizes = [p for p in pieces if not isinstance(p, str)]
    images = [random_image(h, w, seed + i) for i, (h, w) in enumerate(sizes)]
    ours, theirs, grids = None, {}, []
    if images:
        out = AutoImageProcessor.from_pretrained(folder)(images=images, return_tensors="pt")
        pixels = out["pixel_values"]
        if "image_grid_thw" in out:
            grids = out["image_grid_thw"]
            ours = ImageInputs(pixels, grids)
            theirs = {"pixel_values": pixels, "image_grid_thw": grids}
        else:
            hw = out["image_sizes"]
            tiles = [prompt.tiling.tiles(h, w) for h, w in hw.tolist()]
            grids = torch.tensor([[n, h, w] for n, (h, w) in zip(tiles, hw.tolist(), strict=True)])
            ours = ImageInputs(
                torch.cat([p[:n].flatten(1) for p, n in zip(pixels, tiles, strict=True)]), grids
            )
            theirs = {"pixel_values": pixels, "image_sizes": hw}
    grid = iter(torch.as_tensor(grids).tolist())
    text = "".join(p if isinstance(p, str) else prompt.text(tuple(next(grid))) for p in pieces)
    ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
    if "image_grid_thw" in theirs or not images:
        theirs["mm_token_type_ids"] = (ids == prompt.token_id).int()
    return ids, ours, theirs


def _theirs(reference, kwargs):
    if reference.config.model_type.startswith("llava"):
        return {k: v for k, v in kwargs.items() if k != "mm_token_type_ids"}
    return kwargs


# ---------------------------------------------------------------------------------------------------------
# LLaVA-NeXT: sizes, tiles, batches


EXTREME = {
    "one-pixel": ["Look ", (1, 1), " now."],
    "sliver-wide": ["Look ", (3, 400), " now."],
    "sliver-tall": ["Look ", (400, 3), " now."],
    "huge-square": ["Look ", (900, 900), " now."],
    "three-tile-counts": ["A ", (500, 500), " B ", (2, 2), " C ", (28, 84), " end."],
    "adjacent": ["Two: ", (29, 61), (61, 29), " done."],
    "first-and-last": [(57, 85), " middle ", (85, 57)],
}


@pytest.mark.parametrize("pieces", list(EXTREME.values()), ids=list(EXTREME))
def test_llava_next_logits_with_extreme_images_equal_transformers(next_dir, references, pieces):
    from shardforge.models import load_model

    ids, images, kwargs = _encode(next_dir, pieces)
    reference = references[next_dir]
    ours = load_model(next_dir).eval()
    with torch.no_grad():
        expected = reference(input_ids=ids, **_theirs(reference, kwargs)).logits
        got = ours(ids, images=images)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


def test_llava_next_tokens_and_tiles_of_extreme_sizes_equal_transformers_processor(next_dir):
    """Token counts (LlavaNextProcessor, num_additional_image_tokens=1, less the class token) and tiles
    (the image processor's) for slivers, single pixels and sizes far past the largest resolution."""
    from transformers import AutoImageProcessor, LlavaNextProcessor

    tokenizer, prompt = _prompt_of(next_dir)
    image_processor = AutoImageProcessor.from_pretrained(next_dir)
    processor = LlavaNextProcessor(
        image_processor, tokenizer, patch_size=14, image_token="<image>",
        vision_feature_select_strategy="default", num_additional_image_tokens=1,
    )  # fmt: skip
    sizes = [(1, 1), (1, 2), (2, 1), (1, 1000), (1000, 1), (3, 5000), (5000, 3), (27, 28), (28, 27),
             (13, 85), (85, 13), (7, 85), (83, 1), (10000, 9999), (2, 3), (55, 57)]  # fmt: skip
    rng = np.random.default_rng(7)
    sizes += [tuple(int(v) for v in np.exp(rng.uniform(0, 8, 2)).astype(int) + 1) for _ in range(300)]
    for h, w in sizes:
        assert prompt.tiling.tokens(h, w) == processor._get_number_of_features(h, w, 28, 28) - 1, (h, w)
    for h, w in [(1, 1), (3, 400), (400, 3), (1, 90), (900, 900)]:
        out = image_processor(images=[random_image(h, w)], return_tensors="np")
        assert out["pixel_values"].shape[1] == prompt.tiling.tiles(h, w), (h, w)


def test_llava_next_batch_rows_of_different_tile_counts_equal_transformers_row_by_row(next_dir, references):
    """Two rows in one forward (right-padded), their images of 5, 4 and 3 tiles in one pixel tensor: each
    row's logits equal transformers' on that row alone."""
    from shardforge.models import load_model

    rows = [_encode(next_dir, ["Q ", (500, 500), " and ", (1, 90), " ok"], seed=0),
            _encode(next_dir, ["R ", (90, 40), " fine"], seed=5)]  # fmt: skip
    width = max(ids.shape[1] for ids, _, _ in rows)
    batch = torch.zeros(len(rows), width, dtype=torch.long)
    for r, (ids, _, _) in enumerate(rows):
        batch[r, : ids.shape[1]] = ids[0]
    images = ImageInputs(torch.cat([im.pixel_values for _, im, _ in rows]),
                         torch.cat([im.grid_thw for _, im, _ in rows]))  # fmt: skip
    assert sorted(images.grid_thw[:, 0].tolist()) == [3, 4, 5]
    reference = references[next_dir]
    ours = load_model(next_dir).eval()
    with torch.no_grad():
        got = ours(batch, images=images)
        for r, (ids, _, kwargs) in enumerate(rows):
            expected = reference(input_ids=ids, **_theirs(reference, kwargs)).logits
            torch.testing.assert_close(got[r : r + 1, : ids.shape[1]], expected, atol=1e-4, rtol=0)


def _config(tmp_path: Path, model_dir: Path, train: list[dict], **data):
    return vision_data_config(tmp_path, model_dir, train, **{"max_length": 512, **data})


_rows = vision_rows


def _records(folder: Path, sizes: list[list[tuple[int, int]]]) -> list[dict]:
    """An openai-format file of records with these images (one list per record), made in `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    lines = []
    for r, record in enumerate(sizes):
        content = [{"type": "text", "text": f"Record {r}: "}]
        for i, (h, w) in enumerate(record):
            random_image(h, w, seed=10 * r + i).save(folder / f"{r}_{i}.png")
            content.append({"type": "image_url", "image_url": {"url": f"{r}_{i}.png"}})
        messages = [{"role": "user", "content": content},
                    {"role": "assistant", "content": f"Answer number {r}."}]  # fmt: skip
        lines.append(json.dumps({"messages": messages}))
    (folder / "data.jsonl").write_text("\n".join(lines) + "\n")
    return [{"path": str(folder / "data.jsonl"), "format": "openai"}]


def test_llava_next_images_resized_by_image_max_and_min_pixels_count_their_tokens(tmp_path, next_dir):
    """data.image_max_pixels / image_min_pixels resize an image before the processor (LF's regularize):
    its tokens and tiles are those of the resized size, and the pixels the processor's on it."""
    from PIL import Image
    from transformers import AutoImageProcessor

    _, prompt = _prompt_of(next_dir)
    train = _records(tmp_path / "data", [[(300, 200), (5, 7)], [(4, 1500)]])
    store = _rows(_config(tmp_path, next_dir, train, image_max_pixels=3000, image_min_pixels=400)).examples
    processor = AutoImageProcessor.from_pretrained(next_dir)
    for r, names in enumerate([["0_0", "0_1"], ["1_0"]]):
        pictures = []
        for name in names:
            image = Image.open(tmp_path / "data" / f"{name}.png")
            for limit, too in ((3000, lambda a: a > 3000), (400, lambda a: a < 400)):
                if too(image.width * image.height):
                    f = (limit / (image.width * image.height)) ** 0.5
                    image = image.resize((int(image.width * f), int(image.height * f)))
            pictures.append(image.convert("RGB"))
        out = processor(images=pictures, return_tensors="np")
        images = store.images(r)
        sizes = out["image_sizes"].tolist()
        tiles = [prompt.tiling.tiles(h, w) for h, w in sizes]
        assert images.grids.tolist() == [[n, h, w] for n, (h, w) in zip(tiles, sizes, strict=True)]
        expected = np.concatenate([out["pixel_values"][i, :n].reshape(n, -1) for i, n in enumerate(tiles)])
        np.testing.assert_array_equal(images.pixels, expected)
        ids, _ = store.arrays(r)
        assert int((ids == prompt.token_id).sum()) == sum(prompt.tiling.tokens(h, w) for h, w in sizes)
        assert int(store.patches[r]) == sum(tiles) * prompt.tiling.tile_patches


def test_a_sliver_that_image_max_pixels_would_shrink_to_nothing_keeps_a_pixel(tmp_path, next_dir):
    """A 1 x 4000 image under image_max_pixels=3000 shrinks (LF's factor, int()) to 3464 x 0, which PIL
    refuses with a ValueError from deep in the encoder: each side keeps at least one pixel instead, and the
    record is read (3464 x 1, in its tiles)."""
    train = _records(tmp_path / "data", [[(1, 4000)]])
    store = _rows(_config(tmp_path, next_dir, train, image_max_pixels=3000)).examples
    assert store.images(0).grids[:, 1:].tolist() == [[1, 3464]]


@pytest.mark.parametrize("chunk", [3, 5, 512], ids=["chunk3", "chunk5", "whole"])
def test_llava_next_greedy_generation_with_odd_images_equals_transformers(next_dir, references, chunk):
    from transformers import AutoTokenizer

    from shardforge.infer.engine import Engine
    from shardforge.infer.engine_types import EngineConfig
    from shardforge.infer.sampling import GenerationDefaults, SamplingParams
    from shardforge.models import load_model

    prompts = [_encode(next_dir, ["See ", (3, 400), " and ", (900, 900)], seed=1),
               _encode(next_dir, [(1, 1), " alone"], seed=2),
               _encode(next_dir, ["last ", (61, 29), (29, 61)], seed=3)]  # fmt: skip
    engine = Engine(load_model(next_dir), AutoTokenizer.from_pretrained(next_dir),
                    EngineConfig(block_size=4, num_blocks=512, max_step_tokens=chunk),
                    GenerationDefaults())  # fmt: skip
    params = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True, logprobs=1)
    for _ in range(
        2
    ):  # the second time, the prompts' cached blocks (cut through the tiles' tokens) are found
        tokens = [ids[0].tolist() for ids, _, _ in prompts]
        done = engine.generate(tokens, params, images=[im for _, im, _ in prompts])
        _same_as_transformers(references[next_dir], prompts, done)
    assert engine.stats().prefix_hits > 0


def _same_as_transformers(reference, prompts, done):
    for ids, _, kwargs in prompts:
        with torch.no_grad():
            out = reference.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW,
                                     min_new_tokens=NEW, do_sample=False, output_logits=True,
                                     return_dict_in_generate=True, **_theirs(reference, kwargs))  # fmt: skip
        tokens = out.sequences[0, ids.shape[1] :].tolist()
        logprobs = [
            torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(out.logits, tokens, strict=True)
        ]
        completion = done.pop(0)[0]
        assert completion.tokens == tokens
        assert [lp for lp, _ in completion.logprobs] == pytest.approx(logprobs, abs=1e-4)


def _greedy_by_forward(reference, ids, _, kwargs, image_token):
    """Greedy tokens and log-probabilities by transformers' whole forward on the growing sequence (no cache):
    the positions training gives the same tokens."""
    tokens, logprobs, seq = [], [], ids
    for _ in range(NEW):
        extra = {**kwargs}
        if "mm_token_type_ids" in extra:
            types = torch.zeros_like(seq)
            types[:, : ids.shape[1]] = ids == image_token
            extra["mm_token_type_ids"] = types.int()
        with torch.no_grad():
            logits = reference(input_ids=seq, **extra).logits[0, -1].float()
        token = int(logits.argmax())
        tokens.append(token)
        logprobs.append(torch.log_softmax(logits, -1)[token].item())
        seq = torch.cat([seq, torch.tensor([[token]])], dim=1)
    return tokens, logprobs


def _same_as(completion, expected):
    tokens, logprobs = expected
    assert completion.tokens == tokens
    assert [lp for lp, _ in completion.logprobs] == pytest.approx(logprobs, abs=1e-4)


def test_llava_next_rows_round_trip_with_tiles_and_a_text_row(tmp_path, next_dir):
    """as_rows / from_rows (a pipeline's cut) on LLaVA-NeXT tiles: rows of 9 tiles (two images), none (text)
    and 3, each chunk exactly its rows' tiles and grids, its logits the whole batch's."""
    from shardforge.data.batching import Batch, collate
    from shardforge.models import load_model

    train = _records(tmp_path / "data", [[(500, 500), (28, 84)], [], [(28, 56)]])
    store = _rows(_config(tmp_path, next_dir, train)).examples
    rows = [[0], [1], [2]]
    batch = collate(store, rows, pad_id=0)
    tiles = batch.images.grid_thw[:, 0].tolist()
    assert batch.images.rows.tolist() == [[2, tiles[0] + tiles[1]], [0, 0], [1, tiles[2]]]
    assert len(set(tiles)) == 3  # three tile counts: the rows' padding to the most is exercised
    model = load_model(next_dir).eval()
    with torch.no_grad():
        whole = model(batch.input_ids, batch.position_ids, batch.doc_ids, images=batch.images)
    fields = batch.fields()
    for r, row in enumerate(rows):
        chunk = Batch.from_fields(
            batch.input_ids[r : r + 1], {k: None if v is None else v[r : r + 1] for k, v in fields.items()}
        )
        alone = collate(store, [row], pad_id=0).images
        if alone is None:
            assert chunk.images is None
        else:
            torch.testing.assert_close(chunk.images.pixel_values, alone.pixel_values, rtol=0, atol=0)
            torch.testing.assert_close(chunk.images.grid_thw, alone.grid_thw, rtol=0, atol=0)
        with torch.no_grad():
            out = model(chunk.input_ids, chunk.position_ids, chunk.doc_ids, images=chunk.images)
        torch.testing.assert_close(out, whole[r : r + 1], rtol=1e-5, atol=1e-5)


def test_llava_next_image_newline_trains_where_lf_trains_it(next_dir):
    """LLaMA-Factory's full tuning freezes by module name (vision_tower, multi_modal_projector,
    language_model / lm_head under freeze_language_model): `model.image_newline` is in none of them, so it
    trains whenever full tuning does, freeze_language_model included."""
    from shardforge.adapters.apply import apply_finetuning
    from shardforge.config.method_schema import MethodSection
    from shardforge.models import load_model
    from shardforge.models.llava.next import NEWLINE

    model = load_model(next_dir)
    vision = {"freeze_projector": False, "freeze_language_model": True}
    apply_finetuning(model, MethodSection(finetuning="full", vision=vision), seed=0)
    trains = {model.canonical_name(n) for n, p in model.named_parameters() if p.requires_grad}
    assert NEWLINE in trains


# ---------------------------------------------------------------------------------------------------------
# Qwen3-VL: positions, packing, chunks, ties


QWEN_PROMPTS = {
    "image-first": [(64, 96), " what is it?"],
    "image-last": ["Describe ", (96, 64)],
    "adjacent": ["Two ", (64, 64), (32, 160), " ok"],
    "only-images": [(64, 64), (96, 32)],
}


@pytest.mark.parametrize("pieces", list(QWEN_PROMPTS.values()), ids=list(QWEN_PROMPTS))
def test_qwen3_vl_logits_with_images_at_the_edges_equal_transformers(qwen3_dir, references, pieces):
    from shardforge.models import load_model

    ids, images, kwargs = _encode(qwen3_dir, pieces)
    ours = load_model(qwen3_dir).eval()
    with torch.no_grad():
        expected = references[qwen3_dir](input_ids=ids, **kwargs).logits
        got = ours(ids, images=images)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


def test_qwen3_vl_packed_documents_restart_m_rope_and_equal_transformers_alone(qwen3_dir, references):
    """One row of three documents (the second starting with its image's tokens, no text before: M-RoPE
    restarts at the image), each document's logits equal transformers' on it alone."""
    from shardforge.models import load_model

    _, prompt = _prompt_of(qwen3_dir)
    docs = [_encode(qwen3_dir, ["First ", (64, 96), " doc"], seed=0),
            _encode(qwen3_dir, [(96, 64), " second"], seed=4),
            _encode(qwen3_dir, ["third, text only"], seed=0)]  # fmt: skip
    # the second document's first tokens are its image's pads (drop the vision_start before them)
    ids1 = docs[1][0][:, 1:]
    assert ids1[0, 0].item() == prompt.token_id
    kw1 = {**docs[1][2], "mm_token_type_ids": (ids1 == prompt.token_id).int()}
    docs[1] = (ids1, docs[1][1], kw1)
    row = torch.cat([d[0] for d in docs], dim=1)
    positions = torch.cat([torch.arange(d[0].shape[1]) for d in docs])[None]
    doc_ids = torch.cat([torch.full((d[0].shape[1],), i) for i, d in enumerate(docs)])[None]
    images = ImageInputs(torch.cat([d[1].pixel_values for d in docs if d[1] is not None]),
                         torch.cat([d[1].grid_thw for d in docs if d[1] is not None]))  # fmt: skip
    ours = load_model(qwen3_dir).eval()
    reference = references[qwen3_dir]
    with torch.no_grad():
        got = ours(row, positions, doc_ids, images=images)
        col = 0
        for ids, _, kwargs in docs:
            expected = reference(input_ids=ids, **kwargs).logits
            torch.testing.assert_close(got[:, col : col + ids.shape[1]], expected, atol=1e-4, rtol=0)
            col += ids.shape[1]


@pytest.mark.parametrize("chunk", [3, 5], ids=["chunk3", "chunk5"])
def test_qwen3_vl_generation_with_chunks_cutting_images_equals_transformers(qwen3_dir, references, chunk):
    """Prefill chunks of 3 and 5 tokens cut every image's tokens (the deepstack features of each chunk's
    image tokens added after the first decoder layers, M-RoPE positions carried over the cut)."""
    from transformers import AutoTokenizer

    from shardforge.infer.engine import Engine
    from shardforge.infer.engine_types import EngineConfig
    from shardforge.infer.sampling import GenerationDefaults, SamplingParams
    from shardforge.models import load_model

    prompts = [_encode(qwen3_dir, pieces, seed=3 * k) for k, pieces in enumerate(QWEN_PROMPTS.values())]
    prompts.append(_encode(qwen3_dir, ["no picture here"]))
    _, prompt = _prompt_of(qwen3_dir)
    ids, images, kwargs = _encode(qwen3_dir, ["Ends in pads ", (64, 32)], seed=9)
    ids = ids[:, :-1]  # the prompt's last token an image token (its vision_end dropped)
    assert ids[0, -1].item() == prompt.token_id
    pads_last = (ids, images, {**kwargs, "mm_token_type_ids": (ids == prompt.token_id).int()})
    engine = Engine(load_model(qwen3_dir), AutoTokenizer.from_pretrained(qwen3_dir),
                    EngineConfig(block_size=4, num_blocks=512, max_step_tokens=chunk),
                    GenerationDefaults())  # fmt: skip
    params = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True, logprobs=1)
    for _ in range(2):  # the second time, the prompts' cached blocks (cut through the images) are found
        tokens = [i[0].tolist() for i, _, _ in prompts]
        done = engine.generate([*tokens, pads_last[0][0].tolist()], params,
                               images=[im for _, im, _ in prompts] + [pads_last[1]])  # fmt: skip
        last = done.pop()
        _same_as_transformers(references[qwen3_dir], prompts, done)
        # transformers' own generate disagrees with its forward here (its decode steps take the prompt's
        # last token type, an image's, for the new tokens): the reference is its forward, token by token
        _same_as(last[0], _greedy_by_forward(references[qwen3_dir], *pads_last, prompt.token_id))
    assert engine.stats().prefix_hits > 0


def test_qwen3_vl_tied_logits_and_export_round_trip(tmp_path, qwen3_tied_dir, references):
    """A tied Qwen3-VL checkpoint: our logits equal transformers'; exported, transformers loads it whole
    (tied, no missing or unexpected key) and gives the same logits."""
    from transformers import AutoTokenizer, Qwen3VLForConditionalGeneration

    from shardforge.models import load_model, save_model

    ours = load_model(qwen3_tied_dir).eval()
    ids, images, kwargs = _encode(qwen3_tied_dir, ["Tied ", (64, 96), " and ", (32, 64), " end"])
    with torch.no_grad():
        expected = references[qwen3_tied_dir](input_ids=ids, **kwargs).logits
        got = ours(ids, images=images)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
    out = save_model(ours, tmp_path / "out", AutoTokenizer.from_pretrained(qwen3_tied_dir))
    back, info = Qwen3VLForConditionalGeneration.from_pretrained(out, output_loading_info=True)
    assert not any(info.values()), info
    assert back.config.tie_word_embeddings
    assert back.lm_head.weight.data_ptr() == back.model.language_model.embed_tokens.weight.data_ptr()
    with torch.no_grad():
        torch.testing.assert_close(back.eval()(input_ids=ids, **kwargs).logits, got, atol=1e-4, rtol=0)


# ---------------------------------------------------------------------------------------------------------
# the blank image; the dataset cache


@pytest.mark.parametrize("family", ["llava_next", "qwen3_vl"])
def test_blank_image_under_bf16_autocast_in_train_mode(next_dir, qwen3_dir, family):
    """A text-only micro-batch in train mode under bf16 autocast: logits equal eval mode's (the blank image
    counts zero times), finite; every trained tower / projector parameter gets a zero gradient."""
    from shardforge.models import load_model

    folder = {"llava_next": next_dir, "qwen3_vl": qwen3_dir}[family]
    model = load_model(folder)
    for p in model.vision_parameters():
        p.requires_grad_(True)
    ids, _, _ = _encode(folder, ["Only some text, with no picture."])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with torch.no_grad():
            expected = model.eval()(ids)
        got = model.train()(ids)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    got.float().sum().backward()
    for name, p in model.named_parameters():
        if model.config.part_of(model.canonical_name(name)) in ("tower", "projector"):
            assert p.grad is not None and torch.isfinite(p.grad).all() and not p.grad.any(), name


def _cache_entry(tmp_path: Path) -> Path:
    (entry,) = [p for p in (tmp_path / "cache").iterdir() if (p / "manifest.json").is_file()]
    return entry


@pytest.mark.parametrize("family", ["llava_next", "qwen3_vl"])
def test_cache_reloaded_keeps_tower_patches_and_old_caches_are_refused(tmp_path, next_dir, qwen3_dir, family):
    """The dataset cache read back from disk has its `patches` array (ImagePrompt.patches of each sequence's
    images); a cache written without patches.npy (as before it was kept) is an error saying to rebuild it
    (the code fingerprint in the cache key already keeps runs from reaching one)."""
    from shardforge.data.store import ExampleStore
    from shardforge.errors import DataError

    folder = {"llava_next": next_dir, "qwen3_vl": qwen3_dir}[family]
    _, prompt = _prompt_of(folder)
    train = _records(tmp_path / "data", [[(500, 500), (28, 84)], [], [(90, 40)], [(64, 64)]])
    config = _config(tmp_path, folder, train)
    built = _rows(config).examples
    expected = [sum(prompt.patches(tuple(g)) for g in (built.images(i).grids.tolist() if built.images(i)
                                                        else [])) for i in range(len(built))]  # fmt: skip
    assert built.patches.tolist() == expected
    entry = _cache_entry(tmp_path)
    assert (entry / "train" / "patches.npy").is_file()
    again = _rows(config)
    assert again.cached_at is not None
    assert np.asarray(again.examples.patches).tolist() == expected
    assert again.group_counts()["patches"].sum() == sum(expected)
    (entry / "train" / "patches.npy").unlink()  # a cache from before `patches` was kept: rebuilt, not read
    with pytest.raises(DataError, match=r"no patches\.npy"):
        ExampleStore.load(entry / "train")


def test_cache_key_covers_the_code_that_counts_image_tokens():
    """The image prompt's token count is written into every cached sequence (each image mark expanded to
    that many tokens): the code that counts them (ImagePrompt, AnyResGrid) must be in the cache key's code
    fingerprint, or a fix to the count meets a stale cache."""
    import inspect

    from shardforge.data import cache
    from shardforge.models.common import images
    from shardforge.models.llava import next as llava_next

    read: list[Path] = []
    original = Path.read_bytes

    def spy(self):
        read.append(self.resolve())
        return original(self)

    Path.read_bytes = spy
    try:
        cache.code_fingerprint([])
    finally:
        Path.read_bytes = original
    for module in (images, llava_next):
        assert Path(inspect.getfile(module)).resolve() in read, module.__name__


@pytest.mark.parametrize("family", ["llava_next", "qwen3_vl"])
def test_a_lora_run_with_the_tower_adapted_reloads_in_peft_exactly(tmp_path, next_dir, qwen3_dir, family):
    """LoRA on the decoder and the tower (freeze_tower false) of LLaVA-NeXT and Qwen3-VL: the run's PEFT
    folder loads onto transformers' model with no missing or unexpected key and gives our logits."""
    import warnings

    from peft import PeftModel

    from shardforge.adapters.apply import apply_finetuning
    from shardforge.config import load_config
    from shardforge.models import load_model
    from shardforge.train.trainer import train
    from tests.unit.test_vision_language import reference_model
    from tests.vision import lf_image_dataset

    folder = {"llava_next": next_dir, "qwen3_vl": qwen3_dir}[family]
    info = lf_image_dataset(tmp_path / "data")
    base = _config(tmp_path, folder, [{"name": "mllm_demo", "dataset_info": str(info)}]).model_dump(
        mode="json"
    )
    base["method"] = {"finetuning": "lora", "lora": {"rank": 4}, "vision": {"freeze_tower": False}}
    base["train"]["lr"] = 0.05
    config = load_config(None, base=base)
    adapter = train(config).final_model
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # peft warns of missing or unexpected adapter keys
        reference = PeftModel.from_pretrained(reference_model(folder), adapter).eval()
    ours = load_model(folder)
    apply_finetuning(ours, config.method, 0, adapter=str(adapter))
    ids, images, kwargs = _encode(folder, ["Look ", (57, 85), " and ", (85, 57), " ok"])
    with torch.no_grad():
        expected = reference(input_ids=ids, **_theirs(reference.get_base_model(), kwargs)).logits
        with reference.disable_adapter():
            untouched = reference.get_base_model()(
                input_ids=ids, **_theirs(reference.get_base_model(), kwargs)
            )
        got = ours.eval()(ids, images=images)
    assert (expected - untouched.logits).abs().max() > 1e-3  # the adapter changes the logits
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


def test_an_image_pil_refuses_as_a_decompression_bomb_is_a_data_error(tmp_path):
    """A huge image (a 20000 x 20000 PNG header: PIL's DecompressionBombError, which is no OSError) is a
    DataError naming it, as a corrupt one is (the server answers a DataError with a 400, anything else with
    a 500)."""
    import struct
    import zlib

    from shardforge.data.images import open_image
    from shardforge.errors import DataError

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", 20000, 20000, 8, 2, 0, 0, 0)
    path = tmp_path / "huge.png"
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0" * 8))
                     + chunk(b"IEND", b""))  # fmt: skip
    with pytest.raises(DataError, match=r"huge\.png"):
        open_image(str(path), "data.jsonl:1")
