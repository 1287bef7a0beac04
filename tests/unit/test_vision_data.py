"""Images through the data path of a vision-language model: LLaMA-Factory's multimodal format and OpenAI's
image parts read, each `<image>` expanded to the image's tokens, image tokens never targets, patches cached
with the tokens, and a training step's loss equal to transformers' on the same batch."""

from __future__ import annotations

import base64
import json
import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardforge.errors import DataError, ModelError
from shardforge.models.common.images import ImageInputs
from tests.vision import (
    lf_image_dataset,
    random_image,
    tiny_gemma3,
    tiny_llava,
    tiny_llava_next,
    tiny_qwen2_vl,
    tiny_qwen3_vl,
    vision_data_config,
    vision_rows,
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_qwen2_vl(tmp_path_factory.mktemp("qwen2_vl"))


_config, _rows = vision_data_config, vision_rows


def test_lf_multimodal_records_expand_each_image_to_its_tokens(tmp_path, model_dir):
    from PIL import Image
    from transformers import AutoImageProcessor, AutoTokenizer

    info = lf_image_dataset(tmp_path / "data")
    config = _config(tmp_path, model_dir, [{"name": "mllm_demo", "dataset_info": str(info)}])
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    processor = AutoImageProcessor.from_pretrained(model_dir)
    records = json.loads((tmp_path / "data" / "mllm_demo.json").read_text())
    for _ in range(2):  # encoded into the cache, then read back from it
        rows = _rows(config)
        store = rows.examples
        assert store.has_images and len(store) == len(records)
        for i, record in enumerate(records):
            ids, trained = store.arrays(i)
            images = store.images(i)
            expected = processor(
                images=[Image.open(tmp_path / "data" / p).convert("RGB") for p in record["images"]],
                return_tensors="np",
            )  # fmt: skip
            np.testing.assert_array_equal(images.grids, expected["image_grid_thw"])
            np.testing.assert_array_equal(images.pixels, expected["pixel_values"])
            assert int((ids == pad).sum()) == int(expected["image_grid_thw"].prod(-1).sum()) // 4
            assert not trained[ids == pad].any()  # never a target
            assert trained.any()


def test_openai_image_parts_and_data_urls(tmp_path, model_dir):
    path = tmp_path / "pic.png"
    random_image(56, 56).save(path)
    url = "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()
    records = [{"messages": [
        {"role": "user", "content": [{"type": "text", "text": "Compare "},
                                      {"type": "image_url", "image_url": {"url": "pic.png"}},
                                      {"type": "text", "text": " with "},
                                      {"type": "image_url", "image_url": {"url": url}}]},
        {"role": "assistant", "content": "They are the same picture."},
    ]}]  # fmt: skip
    data = tmp_path / "openai.jsonl"
    data.write_text(json.dumps(records[0]) + "\n")
    rows = _rows(_config(tmp_path, model_dir, [{"path": str(data), "format": "openai"}]))
    images = rows.examples.images(0)
    assert images.grids.tolist() == [[1, 4, 4], [1, 4, 4]]
    np.testing.assert_array_equal(images.pixels[:16], images.pixels[16:])  # the same picture twice


@pytest.mark.parametrize(
    "record, message",
    [
        (
            {
                "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}],
                "images": ["missing.png"],
            },
            "image 'missing.png' not found",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": "<image><image>"},
                    {"role": "assistant", "content": "Yo"},
                ],
                "images": ["pic.png"],
            },
            "2 <image> mark(s) in the messages but 1 image(s)",
        ),
        (
            {
                "messages": [{"role": "user", "content": "<image>"}, {"role": "assistant", "content": "Yo"}],
                "images": ["bad.png"],
            },
            "cannot read image",
        ),
        (
            {
                "messages": [{"role": "user", "content": "<video>"}, {"role": "assistant", "content": "Yo"}],
                "videos": ["v.mp4"],
            },
            'the record has "videos"',
        ),
        (
            {
                "messages": [{"role": "user", "content": "<image>"}, {"role": "assistant", "content": "Yo"}],
                "images": ["https://example.com/a.png"],
            },
            "is a remote URL",
        ),
        (  # no images, but the image token spelled out: it would be taken for an image's
            {
                "messages": [
                    {"role": "user", "content": "Hi <|image_pad|>"},
                    {"role": "assistant", "content": "Yo"},
                ]
            },
            "holds the model's image token 1 time(s) but the record has no images",
        ),
    ],
    ids=["missing", "count", "corrupt", "video", "remote", "spelled-token"],
)
def test_bad_images_are_errors_naming_the_record(tmp_path, model_dir, record, message):
    random_image(56, 56).save(tmp_path / "pic.png")
    (tmp_path / "bad.png").write_bytes(b"not a png")
    data = tmp_path / "bad.jsonl"
    data.write_text(json.dumps(record) + "\n")
    with pytest.raises(DataError, match=r"bad\.jsonl:1: ") as err:
        _rows(_config(tmp_path, model_dir, [{"path": str(data), "format": "openai"}]))
    assert message in str(err.value)


def test_an_image_cut_by_truncation_is_an_error(tmp_path, model_dir):
    info = lf_image_dataset(tmp_path / "data", count=1)
    config = _config(tmp_path, model_dir, [{"name": "mllm_demo", "dataset_info": str(info)}], max_length=8)
    with pytest.raises(DataError, match="an image is never cut"):
        _rows(config)


def test_images_for_a_text_model_are_refused(tmp_path, tokenizer_dir):
    from shardforge.config import load_config

    info = lf_image_dataset(tmp_path / "data", count=1)
    config = load_config(None, base={
        "model": {"preset": "tiny-llama", "tokenizer": str(tokenizer_dir)},
        "data": {"train": [{"name": "mllm_demo", "dataset_info": str(info)}], "cache": False},
        "output_dir": str(tmp_path / "run"),
    })  # fmt: skip
    with pytest.raises(DataError, match="is a text model"):
        _rows(config)


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory):
    return tiny_llava(tmp_path_factory.mktemp("llava"))


@pytest.fixture(scope="module")
def qwen3_vl_dir(tmp_path_factory):
    return tiny_qwen3_vl(tmp_path_factory.mktemp("qwen3_vl"))


@pytest.fixture(scope="module")
def llava_next_dir(tmp_path_factory):
    return tiny_llava_next(tmp_path_factory.mktemp("llava_next"))


@pytest.fixture(scope="module")
def qwen2_5_vl_dir(tmp_path_factory):
    return tiny_qwen2_vl(tmp_path_factory.mktemp("qwen2_5_vl"), kind="qwen2_5_vl")


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "llava", "llava_next"])
@pytest.mark.parametrize("packing", [False, True])
def test_the_first_step_loss_equals_transformers(
    tmp_path, model_dir, qwen2_5_vl_dir, qwen3_vl_dir, llava_dir, llava_next_dir, family, packing
):
    """A micro-batch of the run (two records, three images, packed into one row or not): our loss equals
    transformers' model's (Qwen2-VL, LLaVA) on the same tokens, images and labels (each document alone)."""
    from shardforge.data.batching import IGNORE, collate
    from shardforge.models import load_model
    from shardforge.objectives import build_objective
    from tests.unit.test_vision_language import reference_model

    folder = {"qwen2_vl": model_dir, "qwen2_5_vl": qwen2_5_vl_dir, "qwen3_vl": qwen3_vl_dir,
              "llava": llava_dir, "llava_next": llava_next_dir}[family]  # fmt: skip
    info = lf_image_dataset(tmp_path / "data")
    config = _config(tmp_path, folder, [{"name": "mllm_demo", "dataset_info": str(info)}], packing=packing)
    store = _rows(config).examples
    batch = collate(store, [[0, 1]] if packing else [[0], [1]], pad_id=0)
    objective = build_objective(config.method)
    ours = load_model(folder)
    with torch.no_grad():
        got = objective.loss(ours(batch.input_ids, **objective.model_inputs(batch)), batch)["loss"]
    reference = reference_model(folder)
    expected = 0.0
    pad = reference.config.image_token_id
    for i in range(2):
        ids, trained = (torch.from_numpy(a) for a in store.arrays(i))
        images = store.images(i)
        pixels, grids = torch.tensor(images.pixels), torch.tensor(images.grids)
        if family.startswith("qwen"):
            kwargs = {"mm_token_type_ids": (ids == pad).int()[None], "pixel_values": pixels,
                      "image_grid_thw": grids}  # fmt: skip
        elif family == "llava_next":  # a tile a row: the images' tiles, and their sizes
            kwargs = {"pixel_values": pixels.view(-1, 3, 28, 28), "image_sizes": grids[:, 1:]}
        else:  # whole images, an image a row
            kwargs = {"pixel_values": pixels.view(len(grids), 3, *(14 * grids[0, 1:]).tolist())}
        with torch.no_grad():
            out = reference(input_ids=ids[None], labels=torch.where(trained, ids, IGNORE)[None], **kwargs)
        expected += out.loss * int(trained[1:].sum())  # the mean over targets, back to a sum
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("family", ["qwen2_vl", "llava", "llava_next"])
def test_a_pipeline_chunk_of_rows_carries_its_own_images_and_positions(
    tmp_path, model_dir, llava_dir, llava_next_dir, family
):
    """What a pipeline schedule does to a micro-batch: its per-row fields (the images and M-RoPE positions
    among them) cut into chunks of rows. Each chunk holds exactly its rows' images (those collate gives the
    rows alone), and the model's output on it equals the whole batch's on those rows (packed and single rows,
    positions made once from the whole batch's token ids)."""
    from dataclasses import replace

    from shardforge.data.batching import Batch, collate
    from shardforge.models import load_model

    folder = {"qwen2_vl": model_dir, "llava": llava_dir, "llava_next": llava_next_dir}[family]
    info = lf_image_dataset(tmp_path / "data", count=5)
    config = _config(tmp_path, folder, [{"name": "mllm_demo", "dataset_info": str(info)}])
    store = _rows(config).examples
    rows = [[0, 1], [2], [3, 4]]
    batch = collate(store, rows, pad_id=0)
    model = load_model(folder).eval()
    inputs = {"position_ids": batch.position_ids, "doc_ids": batch.doc_ids}
    with torch.no_grad():
        whole = model(batch.input_ids, **inputs, images=batch.images)
    rotary = model.rotary_positions(batch.input_ids, batch.position_ids, batch.images)
    staged = replace(batch, images=replace(batch.images, positions=rotary))
    fields = staged.fields()
    for r, row in enumerate(rows):
        chunk = Batch.from_fields(batch.input_ids[r : r + 1], {k: v[r : r + 1] for k, v in fields.items()})
        alone = collate(store, [row], pad_id=0).images
        torch.testing.assert_close(chunk.images.pixel_values, alone.pixel_values, rtol=0, atol=0)
        torch.testing.assert_close(chunk.images.grid_thw, alone.grid_thw, rtol=0, atol=0)
        with torch.no_grad():
            out = model(chunk.input_ids, chunk.position_ids, chunk.doc_ids, images=chunk.images)
        torch.testing.assert_close(out, whole[r : r + 1], rtol=1e-5, atol=1e-5)
    if family == "qwen2_vl":  # a later stage, given no positions, cannot make M-RoPE's from the stream
        stream = torch.zeros(*batch.input_ids.shape, 8)
        with pytest.raises(ModelError, match="need the token ids"):
            model.rotary_positions(stream, batch.position_ids, batch.images)


@pytest.mark.parametrize(
    "finetuning, vision, trains",
    [
        ("full", {}, {"language"}),  # LLaMA-Factory's defaults: the tower and the projector frozen
        ("full", {"freeze_tower": False}, {"language", "tower"}),
        ("full", {"freeze_projector": False, "freeze_language_model": True}, {"projector"}),
        ("freeze", {"freeze_tower": False}, {"language", "tower"}),
        ("lora", {}, {"language"}),
    ],
)
def test_method_vision_says_which_parts_train(model_dir, finetuning, vision, trains):
    from shardforge.adapters.apply import apply_finetuning
    from shardforge.config.method_schema import MethodSection
    from shardforge.models import load_model

    model = load_model(model_dir)
    apply_finetuning(model, MethodSection(finetuning=finetuning, vision=vision), seed=0)
    parts = {model.config.part_of(n) for n, p in model.named_parameters() if p.requires_grad}
    assert parts == trains


def test_lora_with_a_projector_or_tower_it_cannot_reach_is_refused(model_dir):
    """LoRA never reaches the projector (LF's `all` leaves it out): unfrozen beside LoRA it is refused, not
    kept frozen silently; nor does a tower train whose linears are none of the targets (Qwen2-VL's are
    qkv, proj, fc1, fc2). The frozen base weights of an adapted tower stay frozen."""
    from shardforge.adapters.apply import apply_finetuning
    from shardforge.config.method_schema import MethodSection
    from shardforge.errors import ConfigError
    from shardforge.models import load_model

    lora = {"finetuning": "lora"}
    with pytest.raises(ConfigError, match="LoRA does not reach the projector"):
        apply_finetuning(load_model(model_dir), MethodSection(**lora, vision={"freeze_projector": False}), 0)
    named = MethodSection(**lora, lora={"targets": ["q_proj"]}, vision={"freeze_tower": False})
    with pytest.raises(ConfigError, match="its linears are fc1, fc2, proj, qkv"):
        apply_finetuning(load_model(model_dir), named, 0)
    model = load_model(model_dir)
    apply_finetuning(model, MethodSection(**lora, vision={"freeze_tower": False}), 0)
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert any(n.startswith("visual.blocks.0.attn.qkv.lora_") for n in trained)
    assert all("lora_" in n for n in trained), sorted(trained)


def _pair_data(folder: Path) -> Path:
    """Preference and KTO records with an image in the prompt (LLaMA-Factory's sharegpt pair form)."""
    random_image(56, 84).save(folder / "a.png")
    random_image(84, 56, seed=1).save(folder / "b.png")
    records = []
    for i, name in enumerate(["a.png", "b.png"] * 2):
        prompt = [{"role": "user", "content": f"<image>Which picture is this ({i})?"}]
        records.append({
            "messages": prompt, "images": [name], "kto_tag": i % 2 == 0,
            "chosen": {"role": "assistant", "content": f"Picture {name}."},
            "rejected": {"role": "assistant", "content": "No idea at all."},
        })  # fmt: skip
    (folder / "pairs.json").write_text(json.dumps(records))
    tags = {"role_tag": "role", "content_tag": "content", "user_tag": "user", "assistant_tag": "assistant"}
    columns = {"messages": "messages", "images": "images"}
    info = {
        "pairs": {"file_name": "pairs.json", "formatting": "sharegpt", "ranking": True,
                  "columns": {**columns, "chosen": "chosen", "rejected": "rejected"}, "tags": tags},
        "kto": {"file_name": "kto.json", "formatting": "sharegpt",
                "columns": {**columns, "kto_tag": "kto_tag"}, "tags": tags},
    }  # fmt: skip
    kto = [{"messages": r["messages"] + [r["chosen"]], "images": r["images"], "kto_tag": r["kto_tag"]}
           for r in records]  # fmt: skip
    (folder / "kto.json").write_text(json.dumps(kto))
    (folder / "dataset_info.json").write_text(json.dumps(info))
    return folder / "dataset_info.json"


@pytest.mark.parametrize("stage, name", [("dpo", "pairs"), ("kto", "kto"), ("rm", "pairs")])
def test_every_chat_objective_trains_with_images(tmp_path, model_dir, stage, name):
    """Each objective that reads chat records runs its steps with the images in the prompt (their tokens
    and patches in every sequence of a group), and its loss moves."""
    from shardforge.config import load_config
    from shardforge.train.trainer import train

    info = _pair_data(tmp_path)
    base = _config(tmp_path, model_dir, [{"name": name, "dataset_info": str(info)}]).model_dump(mode="json")
    base["method"] = {"stage": stage}
    base["train"] |= {"steps": 3, "micro_batch": 1}
    result = train(load_config(None, base=base))
    losses = [h["loss"] for h in result.history]
    assert all(np.isfinite(losses)) and losses[0] != losses[-1]


def test_context_parallel_with_a_pipeline_is_refused(tmp_path, model_dir, qwen3_vl_dir):
    from shardforge.config import load_config
    from shardforge.errors import ConfigError
    from shardforge.models.build import check_model_source
    from shardforge.planner.layout import check_layout

    info = _pair_data(tmp_path)
    base = _config(tmp_path, model_dir, [{"name": "pairs", "dataset_info": str(info)}]).model_dump(
        mode="json"
    )
    shape = check_model_source(load_config(None, base=base).model)
    check_layout(
        load_config(None, base={**base, "method": {"stage": "sft"}, "parallel": {"cp": 2}}), 2, shape
    )
    with pytest.raises(ConfigError, match=r"parallel\.cp=2 with parallel\.pp=2: a vision-language model"):
        cp_pp = {"cp": 2, "pp": 2, "dp_shard": 1, "zero_stage": 3}
        check_layout(
            load_config(None, base={**base, "method": {"stage": "sft"}, "parallel": cp_pp}), 4, shape
        )
    check_layout(load_config(None, base={**base, "parallel": {"pp": 2, "dp_shard": 1}}), 2, shape)
    check_layout(load_config(None, base={**base, "method": {"stage": "grpo"}}), 1, shape)  # takes images
    # Qwen3-VL's deepstack features join the stream after its first layers: the whole stream, not SP's shard
    qwen3 = check_model_source(load_config(None, base={**base, "model": {"path": str(qwen3_vl_dir)}}).model)
    tp = {"tp": 2, "dp_shard": 1}
    with pytest.raises(ConfigError, match="sequence_parallel: false"):
        check_layout(load_config(None, base={**base, "parallel": tp}), 2, qwen3)
    check_layout(load_config(None, base={**base, "parallel": {**tp, "sequence_parallel": False}}), 2, qwen3)


@pytest.mark.parametrize("tower", [False, True], ids=["decoder", "tower-too"])
@pytest.mark.parametrize("family", ["qwen2_vl", "llava", "gemma3"])
def test_a_lora_run_hands_back_an_adapter_peft_reloads_exactly(tmp_path, model_dir, llava_dir, family, tower):
    """LoRA on the decoder of a VLM, and in its tower too (LF's freeze_vision_tower false): the run's PEFT
    folder loads onto transformers' model with no missing or unexpected key (peft names modules as
    transformers 5 holds them: model.language_model.*, model.visual.*; LLaVA's CLIP tower has q_proj /
    k_proj / v_proj too, which target_modules must not reach where the tower is frozen, nor its layers after
    the feature layer where it is not), and gives our logits with images; our own reader takes the folder
    back."""
    import warnings

    from peft import PeftModel

    from shardforge.adapters.apply import apply_finetuning
    from shardforge.config import load_config
    from shardforge.models import load_model
    from shardforge.train.trainer import train
    from tests.unit.test_vision_language import SAMPLES, encode, reference_inputs, reference_model

    folder = {"qwen2_vl": model_dir, "llava": llava_dir}.get(family) or tiny_gemma3(tmp_path / "gemma3")
    info = lf_image_dataset(tmp_path / "data")
    base = _config(tmp_path, folder, [{"name": "mllm_demo", "dataset_info": str(info)}]).model_dump(
        mode="json"
    )
    base["method"] = {"finetuning": "lora", "lora": {"rank": 4}, "vision": {"freeze_tower": not tower}}
    base["train"]["lr"] = 0.05
    config = load_config(None, base=base)
    adapter = train(config).final_model
    assert (adapter / "adapter_config.json").is_file()
    stored = json.loads((adapter / "adapter_config.json").read_text())["target_modules"]
    assert tower == any("vision" in t or "visual" in t or t in ("qkv", "fc1") for t in stored), stored
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # peft warns of missing or unexpected adapter keys
        reference = PeftModel.from_pretrained(reference_model(folder), adapter).eval()
    ours = load_model(folder)
    apply_finetuning(ours, config.method, 0, adapter=str(adapter))
    ids, images, kwargs = encode(folder, SAMPLES[2])
    kwargs = reference_inputs(reference, ids, kwargs)
    with torch.no_grad():
        expected = reference(input_ids=ids, **kwargs).logits
        with reference.disable_adapter():
            untouched = reference.get_base_model()(input_ids=ids, **kwargs).logits
        got = ours.eval()(ids, images=images)
    assert (expected - untouched).abs().max() > 1e-3  # the adapter changes the logits
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "llava", "llava_next"])
def test_the_cost_model_counts_the_tower(
    tmp_path, model_dir, qwen2_5_vl_dir, llava_dir, llava_next_dir, family
):
    """The parameters are the built model's (tower and projector included); every image patch of a step is
    counted (the MFU numerator's tower term: once through a frozen tower, three times through a training
    one); the tower's FLOPs per patch are two per weight (FlopCounterMode on the tower's forward, within the
    attention scores and norms it leaves out)."""
    from torch.utils.flop_counter import FlopCounterMode

    from shardforge.models import load_model
    from shardforge.models.spec import costs_for

    folder = {"qwen2_vl": model_dir, "qwen2_5_vl": qwen2_5_vl_dir, "llava": llava_dir,
              "llava_next": llava_next_dir}[family]  # fmt: skip
    model = load_model(folder)
    costs = costs_for(model.config)
    assert costs.params.total == sum(p.numel() for p in model.parameters())
    info = lf_image_dataset(tmp_path / "data")
    store = _rows(_config(tmp_path, folder, [{"name": "mllm_demo", "dataset_info": str(info)}])).examples
    grids = np.asarray(store.grids)
    tiles = family == "llava_next"  # grids: (tiles, height, width) in pixels; each tile 2 x 2 patches
    per_image = grids[:, 0] * 4 if tiles else np.prod(grids, axis=1)
    assert int(store.patches.sum()) == int(per_image.sum()) > 0
    patches = int(store.patches[0])
    text = costs.train_flops(100, 10, 5050)
    assert costs.train_flops(100, 10, 5050, patches=patches) == pytest.approx(
        text + patches * costs.patch_flops
    )
    trained = costs.train_flops(100, 10, 5050, patches=patches, tower_passes=3)
    assert trained == pytest.approx(text + 3 * patches * costs.patch_flops)
    images = store.images(0)
    inputs = ImageInputs(torch.tensor(images.pixels), torch.tensor(images.grids))
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model.image_embeddings(inputs, torch.float32)
    # the tower's class token is left out too: one per 576 patches in LLaVA's towers, but one per 4 in the
    # tiny LLaVA-NeXT's tiles (a fifth of its tower's tokens)
    rel = 0.08 if tiles else 0.05
    assert costs.patch_flops * patches == pytest.approx(counter.get_total_flops(), rel=rel)


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "llava", "llava_next"])
def test_the_tower_s_activations_per_patch_are_what_it_keeps(
    model_dir, qwen2_5_vl_dir, qwen3_vl_dir, llava_dir, llava_next_dir, family
):
    """The cost model's bytes a training tower keeps per patch (its layers' and the projector's widths)
    against activation_report of the tower's forward on an image: within 25% for every family (the tiny
    towers' 32 widths make the per-patch scalars and Qwen2.5-VL's window bookkeeping count for more than
    in real ones)."""
    from shardforge.models import load_model
    from shardforge.models.spec import costs_for
    from shardforge.parallel.activations import activation_report
    from tests.unit.test_vision_language import encode

    folder = {"qwen2_vl": model_dir, "qwen2_5_vl": qwen2_5_vl_dir, "qwen3_vl": qwen3_vl_dir,
              "llava": llava_dir, "llava_next": llava_next_dir}[family]  # fmt: skip
    model = load_model(folder).train()
    _, images, _ = encode(folder, ((112, 168),))
    report = activation_report(model, lambda: model.image_embeddings(images, torch.float32))
    grids = images.grid_thw
    side = int(model.config.vision["image_size"]) // 14 if family.startswith("llava") else 0
    patches = {  # what the tower runs: patches, and CLIP's class token per image or tile
        "llava": side * side + 1, "llava_next": int(grids[:, 0].sum()) * (side * side + 1),
    }.get(family, int(grids.prod(-1).sum()))  # fmt: skip
    planned = costs_for(model.config).patch_activations * 4 * patches
    assert report.total_bytes == pytest.approx(planned, rel=0.25)


@pytest.mark.parametrize("finetuning", ["full", "lora"])
def test_the_planner_counts_a_training_tower_s_activations_and_time(tmp_path, model_dir, finetuning):
    """A tower that gets gradients (trained, or adapters in it) keeps activations for one image of
    data.image_max_pixels per row, on the first pipeline stage, and its FLOPs (two or three passes) join
    the step's, whole on every tensor-parallel rank; a frozen tower keeps none and runs once."""
    from dataclasses import replace

    from shardforge.config import load_config
    from shardforge.models.build import check_model_source
    from shardforge.models.spec import spec_for
    from shardforge.planner.layout import Layout
    from shardforge.planner.memory import MemoryModel
    from shardforge.planner.timing import TimeModel
    from tests.unit.large_models import h100s

    base = _config(tmp_path, model_dir, [{"path": "unread.json"}]).model_dump(mode="json")
    base["method"] = {"finetuning": finetuning}
    shape = check_model_source(load_config(None, base=base).model)
    costs = spec_for(shape.family).costs(shape)
    layout = Layout(1, 1, 2, 1, 1, 1, 0, False, "none", "none", 2, 1)
    pixels = base["data"]["image_max_pixels"]
    patches = shape.planned_patches(pixels)
    assert patches == (int(pixels**0.5) // 28 * 2) ** 2  # a square image, whole 28-pixel tokens
    figures = {}
    for frozen in (True, False):
        cfg = load_config(
            None, base={**base, "method": {**base["method"], "vision": {"freeze_tower": frozen}}}
        )
        memory, timing = MemoryModel(cfg, shape, costs), TimeModel(cfg, shape, costs, h100s(2), 1.0)
        pp = replace(layout, tp=1, pp=2, pp_microbatches=2)  # 1F1B: the first stage holds 2 chunks of 1 row
        kept = (memory.activations(layout, None), memory.activations(pp, ((0,), (1,))))
        figures[frozen] = (
            kept,
            timing.tower_flops(2),
            timing.estimate(layout, memory.states(layout, None)[0], 2),
        )
    (kept_frozen, flops_frozen, step_frozen), (kept, flops, step) = figures[True], figures[False]
    per_row = patches * costs.patch_activations * 4
    assert kept[0] - kept_frozen[0] == pytest.approx(2 * per_row)
    assert kept[1] - kept_frozen[1] == pytest.approx(2 * per_row)  # on the first stage only
    assert flops_frozen == 2 * patches * costs.patch_flops
    assert flops == flops_frozen * (2 if finetuning == "lora" else 3)
    assert step.model_flops - step_frozen.model_flops == pytest.approx(flops - flops_frozen)
    assert step.parts["compute"] > step_frozen.parts["compute"]
    # once the data are read, their patches per row replace the planned image's (here 2.5 of them)
    data = 2.5 * patches
    memory, timing = MemoryModel(cfg, shape, costs, data), TimeModel(cfg, shape, costs, h100s(2), 1.0, data)
    assert memory.activations(layout, None) - kept_frozen[0] == pytest.approx(2 * 2.5 * per_row)
    assert timing.tower_flops(2) == pytest.approx(2.5 * flops)


def test_a_run_plans_again_with_its_data_s_images_and_stops_if_they_do_not_fit(tmp_path, model_dir):
    """The layout is checked before the data are read (one image of data.image_max_pixels a row); once
    they are, the estimate is made again with their mean tower patches per row (logged), and where the
    data's images would not fit the device's memory the run stops there, before training, saying so."""
    from shardforge.config import load_config
    from shardforge.errors import ConfigError
    from shardforge.models.build import check_model_source
    from shardforge.planner.preflight import resolve_layout, with_data
    from shardforge.train.trainer import train

    info = lf_image_dataset(tmp_path / "data", count=4)
    base = _config(tmp_path, model_dir, [{"name": "mllm_demo", "dataset_info": str(info)}]).model_dump(
        mode="json"
    )
    base["method"] = {"vision": {"freeze_tower": False}}
    base["train"]["steps"] = 1
    config = load_config(None, base=base)
    store = _rows(config).examples
    mean = store.patches.sum() / len(store)  # one record a row (no packing)
    said: list[logging.LogRecord] = []
    heard = logging.Handler(logging.INFO)
    heard.emit = said.append  # type: ignore[method-assign]
    logging.getLogger("shardforge").addHandler(heard)
    try:
        train(config)
    finally:
        logging.getLogger("shardforge").removeHandler(heard)
    assert any(f"the data hold {mean:.0f} tower patches per row" in r.getMessage() for r in said)
    shape = check_model_source(config.model)
    need = resolve_layout(config, 1, shape, measure=False).estimate.memory.device_bytes
    small = load_config(None, base={**base, "hardware": {"memory_gib": 1.5 * need / 2**30}})
    resolved = resolve_layout(small, 1, shape, measure=False)  # fits as planned
    assert with_data(resolved, 1, shape, float(mean), False).estimate.fits
    with pytest.raises(ConfigError, match="the layout will not run"):
        with_data(resolved, 1, shape, 1e6, False)  # a million patches a row


IMAGE_VALUES = st.sampled_from(["pic.png", "missing.png", "data:image/png;base64,AAAA", "data:text/x;base64,",
                                "https://x/a.png", "", "/etc/passwd", "<image>"])  # fmt: skip
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8) | IMAGE_VALUES,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)
PART = st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "image_url", "input_audio", 3, None])},
    optional={"text": JSON, "image_url": JSON | st.fixed_dictionaries({"url": IMAGE_VALUES})},
)
TURN = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "system", 1])},
    optional={"content": st.lists(PART, max_size=3) | st.text(max_size=12) | IMAGE_VALUES | JSON},
)
GOOD_PART = st.sampled_from([{"type": "text", "text": "Look: "}, {"type": "text", "text": "<image>"},
                             {"type": "image_url", "image_url": {"url": "pic.png"}}])  # fmt: skip
PAIR = st.builds(  # a well-formed exchange, so that records are also read, not only refused
    lambda prompt, reply: [{"role": "user", "content": prompt}, {"role": "assistant", "content": reply}],
    st.lists(GOOD_PART, max_size=3) | st.lists(PART, max_size=2) | st.sampled_from(["<image>Hi", "Hi"]),
    st.sampled_from(["ok", "<image>"]),
)
RECORD = st.fixed_dictionaries(
    {"messages": PAIR | st.lists(TURN, max_size=4) | JSON},
    optional={"images": st.just(["pic.png"]) | st.lists(IMAGE_VALUES, max_size=3) | JSON, "videos": JSON},
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    record=RECORD, fmt=st.sampled_from(["openai", "sharegpt"]), stage=st.sampled_from(["sft", "dpo", "pt"])
)
def test_any_record_with_images_is_read_or_refused_with_its_source(tmp_path_factory, record, fmt, stage):
    """Records of any shape with images, image parts and marks among them: a record (whose images are
    resolved files or data URLs, one per mark) or a DataError naming it, never a traceback."""
    from dataclasses import replace

    from shardforge.config.method_schema import MethodSection
    from shardforge.data.formats import default_fields, parse_record
    from shardforge.data.media import IMAGE
    from shardforge.objectives import build_objective, reading_of

    folder = tmp_path_factory.getbasetemp() / "fuzz-images"
    folder.mkdir(exist_ok=True)
    random_image(28, 28).save(folder / "pic.png")
    how = reading_of(build_objective(MethodSection(stage=stage)))
    fields = replace(default_fields(fmt), messages="messages", role="role", content="content", media=folder)
    try:
        parsed = parse_record(record, "f:1", fmt, fields, how)
    except DataError as e:
        assert str(e).startswith("f:1: ")
        return
    marks = sum(m["content"].count(IMAGE) for m in parsed.messages or () if isinstance(m.get("content"), str))
    assert not parsed.images or marks == len(parsed.images)
    assert all(ref.startswith("data:image/") or Path(ref).is_file() for ref in parsed.images)
