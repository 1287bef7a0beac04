"""Adversarial checks of Gemma 3 with images on the generic backend (models/generic/vision.py): the training
forward over padded rows with images in some rows only, the first step's loss and gradients against
transformers' Gemma3ForConditionalGeneration row by row, the engine (recompute runner) under continuous
batching, prefix-cache hits, preemption, n > 1 and a sampled image token, the data path on folders without
image tokens or an image processor, and the planner's parameter counts."""

from __future__ import annotations

import json

import pytest
import torch

from tests.unit.test_vision_language import SAMPLES, encode, reference_inputs, reference_model
from tests.vision import (
    lf_image_dataset,
    mixed_image_dataset,
    random_image,
    tiny_gemma3,
    vision_data_config,
    vision_rows,
)

NEW = 8


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tiny_gemma3(tmp_path_factory.mktemp("gemma3"))


@pytest.fixture(scope="module")
def reference(folder):
    return reference_model(folder)


@pytest.fixture(scope="module")
def ours(folder):
    from shardforge.models import load_model

    return load_model(folder).eval()


def _prompt(folder, text_parts, images_seed=0):
    """Token ids of `text_parts` (str, or None for an image: its full_image_sequence), the images as our
    forward takes them, and transformers' kwargs."""
    from transformers import AutoImageProcessor, AutoTokenizer

    from shardforge.config.schema import ModelSection
    from shardforge.models.build import check_model_source
    from shardforge.models.common.images import ImageInputs

    tokenizer = AutoTokenizer.from_pretrained(folder)
    prompt = check_model_source(ModelSection(path=str(folder))).image_prompt(tokenizer)
    count = sum(p is None for p in text_parts)
    text = "".join(prompt.text((1, 4, 4)) if p is None else p for p in text_parts)
    ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
    if not count:
        return ids, None, {}
    pics = [random_image(40 + 8 * i, 70 - 4 * i, images_seed + i) for i in range(count)]
    pixels = AutoImageProcessor.from_pretrained(folder)(images=pics, return_tensors="pt")["pixel_values"]
    grids = torch.tensor([[1, 4, 4]] * count)
    return ids, ImageInputs(pixels.flatten(1), grids), {"pixel_values": pixels}


def _theirs(reference, ids, kwargs):
    with torch.no_grad():
        return reference(input_ids=ids, **reference_inputs(reference, ids, kwargs)).logits


# ---- the forward ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "parts",
    [
        [None, "What is this?"],  # the image first
        ["Compare", None, None, "now."],  # two images back to back
        ["Look at the end:", None],  # the image last
        [None, None, None],  # only images
    ],
    ids=["first", "adjacent", "last", "only-images"],
)
def test_image_placement_logits_equal_transformers(folder, reference, ours, parts):
    ids, images, kwargs = _prompt(folder, parts)
    with torch.no_grad():
        got = ours(ids, images=images)
    torch.testing.assert_close(got, _theirs(reference, ids, kwargs), atol=1e-4, rtol=0)


def test_a_right_padded_batch_with_images_in_some_rows_equals_each_row_alone(folder, reference, ours):
    """Rows of different lengths, right-padded as collate pads them (pad id 0, positions 0, no doc ids),
    images in the first and third rows only: every real token's logits equal transformers' on the row
    alone."""
    from shardforge.models.common.images import ImageInputs

    rows = [
        _prompt(folder, ["Describe", None, "please, in detail, with many words of text."], 0),
        _prompt(folder, ["A row of plain text only, no image in it."], 0),
        _prompt(folder, [None, None], 5),
        _prompt(folder, ["Tiny"], 0),
    ]
    width = max(ids.shape[1] for ids, _, _ in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    positions = torch.zeros(len(rows), width, dtype=torch.long)
    for r, (row, _, _) in enumerate(rows):
        ids[r, : row.shape[1]] = row[0]
        positions[r, : row.shape[1]] = torch.arange(row.shape[1])
    found = [im for _, im, _ in rows if im is not None]
    images = ImageInputs(
        torch.cat([im.pixel_values for im in found]), torch.cat([im.grid_thw for im in found])
    )
    with torch.no_grad():
        got = ours(ids, positions, images=images)
    for r, (row, _, kwargs) in enumerate(rows):
        expected = _theirs(reference, row, kwargs)
        torch.testing.assert_close(got[r : r + 1, : row.shape[1]], expected, atol=1e-4, rtol=0)


# ---- training ------------------------------------------------------------------------------------------


def _their_loss(reference, store, indices):
    """transformers' summed loss over the documents `indices`, each alone (a mean over its targets, back to
    a sum), with its images."""
    from shardforge.data.batching import IGNORE

    total = 0.0
    for i in indices:
        ids, trained = (torch.from_numpy(a) for a in store.arrays(i))
        kwargs = {}
        images = store.images(i)
        if images is not None:
            kwargs["pixel_values"] = torch.tensor(images.pixels).view(len(images.grids), 3, 56, 56)
        kwargs = reference_inputs(reference, ids[None], kwargs)
        out = reference(input_ids=ids[None], labels=torch.where(trained, ids, IGNORE)[None], **kwargs)
        total = total + out.loss * int(trained[1:].sum())
    return total


@pytest.mark.parametrize("vision", [{}, {"freeze_tower": False, "freeze_projector": False}],
                         ids=["tower-frozen", "tower-trained"])  # fmt: skip
@pytest.mark.parametrize("picked", [[0, 4, 1, 5], [4, 5, 6]], ids=["mixed", "text-only"])
def test_the_first_step_loss_and_gradients_with_mixed_rows_equal_transformers(
    tmp_path, folder, vision, picked
):
    """A micro-batch of four rows (an image, text only, two images, text only; right-padded): our summed
    loss equals transformers' row by row, and so does every trained parameter's gradient (the tower's too
    where it trains)."""
    from shardforge.adapters.apply import apply_finetuning
    from shardforge.config import load_config
    from shardforge.data.batching import collate
    from shardforge.models import load_model
    from shardforge.objectives import build_objective

    info = mixed_image_dataset(tmp_path / "data")
    base = vision_data_config(tmp_path, folder, [{"name": "mllm_demo", "dataset_info": str(info)}])
    base = base.model_dump(mode="json")
    base["method"] = {"finetuning": "full", "vision": vision}
    config = load_config(None, base=base)
    store = vision_rows(config).examples
    assert [store.images(i) is not None for i in picked] == [i < 4 for i in picked]
    batch = collate(store, [[i] for i in picked], pad_id=0)
    objective = build_objective(config.method)
    model = load_model(folder)
    apply_finetuning(model, config.method, seed=0)
    model.train()
    got = objective.loss(model(batch.input_ids, **objective.model_inputs(batch)), batch)["loss"]
    got.backward()
    reference = reference_model(folder).train()
    for p in reference.parameters():
        p.requires_grad_(False)
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    theirs = dict(reference.named_parameters())
    for name in trained:
        theirs[name.removeprefix("hf.")].requires_grad_(True)
    expected = _their_loss(reference, store, picked)
    expected.backward()
    torch.testing.assert_close(got.detach(), expected.detach(), rtol=1e-5, atol=1e-4)
    assert any("vision_tower" in n for n in trained) == bool(vision)
    for name in sorted(trained):
        mine, other = model.get_parameter(name).grad, theirs[name.removeprefix("hf.")].grad
        other = torch.zeros_like(mine) if other is None else other
        torch.testing.assert_close(mine, other, rtol=1e-4, atol=1e-5, msg=name)


# ---- data on folders that cannot read images ------------------------------------------------------------


def _without(folder, tmp_path, what):
    """A copy of the folder without Gemma 3's image tokens in its tokenizer ("tokens") or without its image
    processor ("processor")."""
    import shutil

    from transformers import AutoTokenizer

    from tests.vision import REPO

    out = tmp_path / f"no-{what}"
    shutil.copytree(folder, out)
    if what == "processor":
        (out / "preprocessor_config.json").unlink()
    else:
        for name in (
            "tokenizer.json",
            "tokenizer_config.json",
            "special_tokens_map.json",
            "added_tokens.json",
        ):
            (out / name).unlink(missing_ok=True)
        AutoTokenizer.from_pretrained(REPO / "examples" / "data" / "tokenizer").save_pretrained(out)
    return out


def _text_dataset(folder):
    folder.mkdir(parents=True, exist_ok=True)
    records = [
        {
            "messages": [
                {"role": "user", "content": f"Question {i}?"},
                {"role": "assistant", "content": "Yes."},
            ]
        }
        for i in range(6)
    ]
    (folder / "text.json").write_text(json.dumps(records))
    return folder / "text.json"


@pytest.mark.parametrize("what", ["tokens", "processor"])
def test_text_only_data_trains_on_a_folder_that_cannot_read_images(tmp_path, folder, what):
    from shardforge.config import load_config
    from shardforge.train.trainer import train

    source = _without(folder, tmp_path, what)
    data = _text_dataset(tmp_path / "data")
    base = vision_data_config(tmp_path, source, [{"path": str(data), "format": "openai"}])
    config = load_config(None, base=base.model_dump(mode="json"))
    result = train(config)
    losses = [h["loss"] for h in result.history]
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))


@pytest.mark.parametrize("what", ["tokens", "processor"])
def test_images_on_a_folder_that_cannot_read_them_are_a_data_error_naming_the_record(tmp_path, folder, what):
    from shardforge.errors import DataError

    source = _without(folder, tmp_path, what)
    info = mixed_image_dataset(tmp_path / "data")
    config = vision_data_config(tmp_path, source, [{"name": "mllm_demo", "dataset_info": str(info)}])
    with pytest.raises(DataError, match=r"mllm_demo\.json:record 0 .*cannot read them"):
        vision_rows(config)


def test_packing_with_images_is_a_clear_error(tmp_path, folder):
    """data.packing with image records on Gemma 3: refused by name (packed rows with images are not
    verified on the generic backend), never a traceback nor a silently different run."""
    from shardforge.config import load_config
    from shardforge.errors import ConfigError, DataError, ModelError
    from shardforge.train.trainer import train

    info = lf_image_dataset(tmp_path / "data", count=4)
    base = vision_data_config(
        tmp_path, folder, [{"name": "mllm_demo", "dataset_info": str(info)}], packing=True
    )
    config = load_config(None, base=base.model_dump(mode="json"))
    with pytest.raises((ConfigError, DataError, ModelError), match="packing"):
        train(config)


def test_packed_text_rows_on_gemma3_equal_each_document_alone(tmp_path, folder, reference):
    """Text-only records packed (gemma3 is among the generic backend's packing families): the loss of a
    packed micro-batch equals transformers' over each document alone."""
    from shardforge.config import load_config
    from shardforge.data.batching import collate
    from shardforge.models import load_model
    from shardforge.objectives import build_objective

    data = _text_dataset(tmp_path / "data")
    base = vision_data_config(tmp_path, folder, [{"path": str(data), "format": "openai"}], packing=True)
    config = load_config(None, base=base.model_dump(mode="json"))
    store = vision_rows(config).examples
    batch = collate(store, [[0, 1, 2], [3, 4]], pad_id=0)
    assert batch.doc_ids is not None
    objective = build_objective(config.method)
    with torch.no_grad():
        got = objective.loss(load_model(folder)(batch.input_ids, **objective.model_inputs(batch)), batch)[
            "loss"
        ]
        expected = _their_loss(reference, store, [0, 1, 2, 3, 4])
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)


# ---- the planner's counts and a tower with a pooling head -----------------------------------------------


@pytest.fixture(scope="module")
def headed(tmp_path_factory, folder):
    """The tiny Gemma 3 with SigLIP's pooling head (vision_use_head, SiglipVisionConfig's default: a
    checkpoint may carry it; its output never reaches the image features)."""
    import shutil

    from transformers import AutoConfig, Gemma3ForConditionalGeneration

    out = tmp_path_factory.mktemp("gemma3-head") / "model"
    shutil.copytree(folder, out)
    cfg = AutoConfig.from_pretrained(folder)
    cfg.vision_config.vision_use_head = True
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    for f in out.glob("*.safetensors"):
        f.unlink()
    model.save_pretrained(out)
    return out


@pytest.mark.parametrize("which", ["plain", "with-head"])
def test_the_planner_counts_every_parameter_and_the_tower_exactly(folder, headed, which):
    """costs' parameter counts (the planner's inventory, from config.json alone) equal the built model's:
    the total, the tower's (SigLIP, its head held as the checkpoint has it) and tower + projector."""
    from shardforge.config.schema import ModelSection
    from shardforge.models import load_model
    from shardforge.models.build import check_model_source
    from shardforge.models.spec import costs_for

    source = folder if which == "plain" else headed
    shape = check_model_source(ModelSection(path=str(source)), weights=False)
    counts = costs_for(shape).params
    model = load_model(source)
    base = model.hf.base_model
    tower = sum(p.numel() for p in base.vision_tower.parameters())
    projector = sum(p.numel() for p in base.multi_modal_projector.parameters())
    assert counts.total == sum(p.numel() for p in model.parameters())
    assert counts.tower == tower
    assert counts.vision == tower + projector


def test_the_tower_s_flops_per_patch_are_what_it_does(tmp_path, folder):
    """Every image's patches (the tower's square: 16 here, whatever the image's size) are counted, and
    patch_flops times them is the tower and projector's forward (FlopCounterMode, within the attention
    scores and norms the GEMM view leaves out)."""
    from torch.utils.flop_counter import FlopCounterMode

    from shardforge.models import load_model
    from shardforge.models.common.images import ImageInputs
    from shardforge.models.spec import costs_for

    model = load_model(folder)
    costs = costs_for(model.config)
    info = lf_image_dataset(tmp_path / "data")
    store = vision_rows(
        vision_data_config(tmp_path, folder, [{"name": "mllm_demo", "dataset_info": str(info)}])
    ).examples
    images = store.images(1)  # two images
    assert int(store.patches[1]) == 2 * 16
    inputs = ImageInputs(torch.tensor(images.pixels), torch.tensor(images.grids))
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model.image_embeddings(inputs, torch.float32)
    assert costs.patch_flops * int(store.patches[1]) == pytest.approx(counter.get_total_flops(), rel=0.1)


@pytest.mark.parametrize(
    "method",
    [
        {"finetuning": "full", "vision": {"freeze_tower": False}},
        {"finetuning": "freeze", "vision": {"freeze_tower": False}},
        {"finetuning": "lora", "lora": {"rank": 4}, "vision": {"freeze_tower": False}},
    ],
    ids=["full", "freeze", "lora"],
)
def test_the_tower_s_pooling_head_never_trains(headed, method):
    """docs/vision.md: the checkpoint's unused pooling head of the tower never trains (nor is adapted),
    while the rest of the tower does."""
    from shardforge.adapters.apply import apply_finetuning
    from shardforge.config.method_schema import MethodSection
    from shardforge.models import load_model

    model = load_model(headed)
    apply_finetuning(model, MethodSection(**method), seed=0)
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    assert not [n for n in trained if ".vision_tower.head." in n]
    assert any(".vision_tower." in n for n in trained)


# ---- a run's export ------------------------------------------------------------------------------------


def test_a_run_that_trains_the_tower_exports_a_folder_transformers_loads(tmp_path, folder):
    """Full tuning with the tower and projector trained on mixed rows: the final folder loads whole into
    transformers' Gemma3ForConditionalGeneration (its tower changed, its embedding still tied) with its
    image processor beside, and our reading of it gives transformers' logits."""
    from transformers import AutoImageProcessor, Gemma3ForConditionalGeneration

    from shardforge.config import load_config
    from shardforge.models import load_model
    from shardforge.train.trainer import train

    info = mixed_image_dataset(tmp_path / "data")
    base = vision_data_config(tmp_path, folder, [{"name": "mllm_demo", "dataset_info": str(info)}])
    base = base.model_dump(mode="json")
    base["method"] = {"finetuning": "full", "vision": {"freeze_tower": False, "freeze_projector": False}}
    base["train"]["steps"] = 3
    final = train(load_config(None, base=base)).final_model
    AutoImageProcessor.from_pretrained(final)
    back, info_ = Gemma3ForConditionalGeneration.from_pretrained(
        final, output_loading_info=True, dtype=torch.float32
    )
    assert not any(info_.values()), info_
    before = reference_model(folder)
    for part in ("vision_tower", "multi_modal_projector", "language_model"):
        changed = [
            not torch.equal(a, b)
            for (_, a), (_, b) in zip(getattr(back.model, part).named_parameters(),
                                      getattr(before.model, part).named_parameters(), strict=True)
        ]  # fmt: skip
        assert any(changed), part
    assert back.lm_head.weight.data_ptr() == back.model.language_model.embed_tokens.weight.data_ptr()
    ids, images, kwargs = encode(final, SAMPLES[2])
    with torch.no_grad():
        got = load_model(final).eval()(ids, images=images)
    torch.testing.assert_close(got, _theirs(back.eval(), ids, kwargs), atol=1e-4, rtol=0)


# ---- RL with image prompts -----------------------------------------------------------------------------


@pytest.mark.parametrize("stage", ["grpo", "ppo"])
def test_rl_with_image_prompts_on_gemma3_scores_as_the_engine_sampled(tmp_path, folder, stage, monkeypatch):
    """GRPO / PPO on Gemma 3 image prompts (the tower trained): the rollout engine's log-probs equal
    transformers' on the prompt, images and completion (image tokens marked both ways), and the training
    forward's equal the engine's."""
    from shardforge.train.trainer import train
    from tests.unit.test_vision_rollouts import compare_first_rollout, rl_config, spied_rollouts

    captured = spied_rollouts(monkeypatch)
    info = mixed_image_dataset(tmp_path / "prompts")
    history = train(rl_config(tmp_path, folder, info, stage=stage, steps=2)).history
    assert history[0]["logprob_delta"] < 1e-5
    assert all(torch.isfinite(torch.tensor(h["loss"])) for h in history)
    compared, _ = compare_first_rollout(captured, reference_model(folder), "gemma3")
    assert compared >= 4


@pytest.mark.parametrize("stage, name", [("dpo", "pairs"), ("kto", "kto"), ("rm", "pairs")])
def test_every_chat_objective_trains_with_images_on_gemma3(tmp_path, folder, stage, name):
    """docs/vision.md: dpo, kto and rm take images; on Gemma 3 (data.packing false, as the generic backend
    asks) each runs its steps, its loss finite and moving."""
    from shardforge.config import load_config
    from shardforge.train.trainer import train
    from tests.unit.test_vision_data import _pair_data

    info = _pair_data(tmp_path)
    base = vision_data_config(tmp_path, folder, [{"name": name, "dataset_info": str(info)}]).model_dump(
        mode="json"
    )
    base["method"] = {"stage": stage}
    base["train"] |= {"steps": 3, "micro_batch": 1}
    losses = [h["loss"] for h in train(load_config(None, base=base)).history]
    assert all(torch.isfinite(torch.tensor(losses))) and losses[0] != losses[-1]


def test_a_gemma3_reward_model_scores_an_image_prompt_as_transformers(tmp_path, folder):
    """A Gemma 3 reward model's folder (Gemma3ForSequenceClassification, as our rm export writes it): our
    score at the last token equals transformers' with the image tokens marked both ways."""
    import transformers

    from shardforge.models import load_model

    cls = transformers.Gemma3ForSequenceClassification
    torch.manual_seed(1)
    rm = cls.from_pretrained(folder, num_labels=1, dtype=torch.float32)
    with torch.no_grad():
        rm.score.weight.normal_(0, 0.3)
    rm.save_pretrained(tmp_path / "rm")
    rm.eval()
    ids, images, kwargs = encode(folder, SAMPLES[2])
    ours = load_model(tmp_path / "rm").eval()
    assert ours.config.num_labels == 1
    with torch.no_grad():
        expected = rm(input_ids=ids, **reference_inputs(rm, ids, kwargs)).logits
        got = ours(ids, images=images)
    torch.testing.assert_close(got[:, -1].reshape(expected.shape), expected, atol=1e-4, rtol=0)


def test_a_pan_and_scan_image_processor_is_read_as_transformers_or_refused_clearly(tmp_path, folder):
    """A Gemma 3 folder whose image processor pans and scans (do_pan_and_scan: a wide image becomes the
    whole image plus crops, each its own image in transformers' Gemma3Processor): the record's tokens and
    images are transformers' processor's, or the folder is refused by name (DataError / ModelError naming
    pan and scan), never an error about truncation or counts that says something else."""
    import shutil

    from shardforge.errors import DataError, ModelError

    source = tmp_path / "pan"
    shutil.copytree(folder, source)
    path = source / "preprocessor_config.json"
    pre = json.loads(path.read_text())
    pre |= {"do_pan_and_scan": True, "pan_and_scan_min_crop_size": 28, "pan_and_scan_max_num_crops": 4,
            "pan_and_scan_min_ratio_to_activate": 1.2}  # fmt: skip
    path.write_text(json.dumps(pre))
    data = tmp_path / "data"
    data.mkdir()
    random_image(56, 224, seed=1).save(data / "wide.png")
    turns = [
        {"role": "user", "content": "<image>What is it?"},
        {"role": "assistant", "content": "A wide picture."},
    ]
    record = {"messages": turns, "images": ["wide.png"]}
    (data / "wide.json").write_text(json.dumps([record]))
    config = vision_data_config(tmp_path, source, [{"path": str(data / "wide.json"), "format": "openai"}])
    try:
        store = vision_rows(config).examples
    except (DataError, ModelError) as exc:
        message = str(exc).replace(str(tmp_path), "")  # the test's folder names pan and scan too
        assert "pan_and_scan" in message or "pan and scan" in message.lower(), message
        return
    from PIL import Image
    from transformers import AutoImageProcessor

    out = AutoImageProcessor.from_pretrained(source)(images=[Image.open(data / "wide.png").convert("RGB")],
                                                    return_tensors="np")  # fmt: skip
    images = store.images(0)
    ids, _ = store.arrays(0)
    assert len(images.pixels) == len(out["pixel_values"]) == 1 + int(out["num_crops"][0])
    assert int(
        (ids == json.loads((source / "config.json").read_text())["image_token_index"]).sum()
    ) == 4 * len(images.pixels)


def test_a_lora_run_with_the_tower_merges_into_a_folder_equal_to_peft_s_merge(tmp_path, folder):
    """`shardforge export --merge` of a LoRA run that adapted the tower too: the merged folder (with its image
    processor) loads whole into transformers and gives peft's merged model's logits with images."""
    import warnings

    from peft import PeftModel
    from transformers import AutoImageProcessor, Gemma3ForConditionalGeneration

    from shardforge.checkpoint.export import export
    from shardforge.config import load_config
    from shardforge.train.trainer import train

    info = mixed_image_dataset(tmp_path / "data")
    base = vision_data_config(tmp_path, folder, [{"name": "mllm_demo", "dataset_info": str(info)}])
    base = base.model_dump(mode="json")
    base["method"] = {"finetuning": "lora", "lora": {"rank": 4}, "vision": {"freeze_tower": False}}
    base["train"]["lr"] = 0.05
    adapter = train(load_config(None, base=base)).final_model
    export(adapter, tmp_path / "merged", merge=True, base=folder)
    merged, loading = Gemma3ForConditionalGeneration.from_pretrained(
        tmp_path / "merged", output_loading_info=True, dtype=torch.float32
    )
    assert not any(loading.values()), loading
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        peft = PeftModel.from_pretrained(reference_model(folder), adapter).merge_and_unload().eval()
    ids, _, kwargs = encode(folder, SAMPLES[2])
    expected = _theirs(peft, ids, kwargs)
    assert (expected - _theirs(reference_model(folder), ids, kwargs)).abs().max() > 1e-3
    torch.testing.assert_close(_theirs(merged.eval(), ids, kwargs), expected, atol=1e-4, rtol=0)
    # docs/vision.md: exported folders carry the image processor beside the tokenizer
    assert (tmp_path / "merged" / "preprocessor_config.json").is_file(), sorted(
        p.name for p in (tmp_path / "merged").iterdir()
    )
    AutoImageProcessor.from_pretrained(tmp_path / "merged")


# ---- the planner's layout rules ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "parallel, message",
    [
        ({"tp": 2, "dp_shard": 1}, r"parallel\.tp=2"),
        ({"pp": 2, "dp_shard": 1}, r"parallel\.pp=2"),
        ({"cp": 2, "dp_shard": 1}, r"parallel\.cp=2"),
    ],
    ids=["tp", "pp", "cp"],
)
def test_layouts_the_generic_backend_cannot_run_with_images_are_refused_by_name(
    tmp_path, folder, parallel, message
):
    from shardforge.config import load_config
    from shardforge.errors import ConfigError
    from shardforge.models.build import check_model_source
    from shardforge.planner.layout import check_layout

    info = lf_image_dataset(tmp_path / "data")
    base = vision_data_config(tmp_path, folder, [{"name": "mllm_demo", "dataset_info": str(info)}])
    base = base.model_dump(mode="json")
    shape = check_model_source(load_config(None, base=base).model)
    check_layout(load_config(None, base={**base, "parallel": {"dp_shard": 2, "zero_stage": 3}}), 2, shape)
    with pytest.raises(ConfigError, match=message):
        check_layout(load_config(None, base={**base, "parallel": parallel}), 2, shape)


@pytest.mark.parametrize("checkpointing", ["full", "selective"])
def test_activation_checkpointing_with_images_is_the_same_run(tmp_path, folder, checkpointing):
    """parallel.activation_checkpoint with image rows and the tower trained: the same losses as without."""
    from shardforge.config import load_config
    from shardforge.train.trainer import train

    info = mixed_image_dataset(tmp_path / "data")
    losses = {}
    for mode in ("none", checkpointing):
        base = vision_data_config(tmp_path / mode, folder, [{"name": "mllm_demo", "dataset_info": str(info)}])
        base = base.model_dump(mode="json")
        base["method"] = {"finetuning": "full", "vision": {"freeze_tower": False}}
        base["parallel"] = {"activation_checkpoint": mode}
        base["train"]["steps"] = 3
        losses[mode] = [h["loss"] for h in train(load_config(None, base=base)).history]
    assert losses[checkpointing] == pytest.approx(losses["none"], rel=1e-5)


@pytest.mark.parametrize(
    "dtype, precision", [("float32", "bf16"), ("bfloat16", "bf16"), ("float32", "fp16")],
    ids=["autocast-bf16", "bf16-weights", "fp16"],
)  # fmt: skip
def test_reduced_precision_runs_with_images_and_the_tower_trained(tmp_path, folder, dtype, precision):
    """Image rows with the tower trained under bf16 / fp16: the run goes (no dtype mismatch between the
    tower, its pixels and the embedded stream) and its first loss is the fp32 run's within rounding."""
    from shardforge.config import load_config
    from shardforge.train.trainer import train

    info = mixed_image_dataset(tmp_path / "data")
    losses = {}
    for name, model_dtype, prec in (("fp32", "float32", "fp32"), ("low", dtype, precision)):
        base = vision_data_config(tmp_path / name, folder, [{"name": "mllm_demo", "dataset_info": str(info)}])
        base = base.model_dump(mode="json")
        base["model"]["dtype"] = model_dtype
        base["method"] = {"finetuning": "full", "vision": {"freeze_tower": False, "freeze_projector": False}}
        base["train"]["precision"] = prec
        losses[name] = [h["loss"] for h in train(load_config(None, base=base)).history]
    assert all(torch.isfinite(torch.tensor(losses["low"])))
    assert losses["low"][0] == pytest.approx(losses["fp32"][0], rel=0.03)


def test_shardforge_plan_on_a_gemma3_image_config_ranks_layouts(tmp_path, folder, capsys):
    """`shardforge plan` on a Gemma 3 run with image data (2 H100s): it plans (no traceback), its layouts use
    no tensor, pipeline or context parallel (refused for the generic backend with images), and the model's
    parameter count it plans with is the whole model's, tower included."""
    import yaml

    from shardforge.cli import main

    info = lf_image_dataset(tmp_path / "data")
    base = vision_data_config(tmp_path, folder, [{"name": "mllm_demo", "dataset_info": str(info)}])
    base = base.model_dump(mode="json", exclude_none=True)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(base))
    assert (
        main(["plan", str(path), "--hardware", "h100", "--nodes", "1", "--devices-per-node", "2", "--json"])
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert out["ranked"], json.dumps(out)[:3000]
    for entry in out["ranked"]:
        assert all(entry["layout"][k] == 1 for k in ("tp", "pp", "cp")), entry["layout"]


def test_the_dataset_cache_never_hands_one_image_processor_s_pixels_to_another(tmp_path, folder):
    """Two Gemma 3 folders alike but for their image processor's normalization, read with one tokenizer
    folder (model.tokenizer) and one dataset cache: each run's cached pixels are its own processor's,
    never the other's (a silently different run)."""
    import shutil

    from transformers import AutoTokenizer

    from shardforge.config import load_config

    tokenizer = tmp_path / "tokenizer"
    AutoTokenizer.from_pretrained(folder).save_pretrained(tokenizer)
    other = tmp_path / "other"
    shutil.copytree(folder, other)
    path = other / "preprocessor_config.json"
    pre = json.loads(path.read_text())
    pre |= {"image_mean": [0.1, 0.2, 0.3], "image_std": [0.3, 0.2, 0.1]}
    path.write_text(json.dumps(pre))
    info = lf_image_dataset(tmp_path / "data", count=2)
    pixels = {}
    for name, source in (("first", folder), ("other", other)):
        base = vision_data_config(tmp_path, source, [{"name": "mllm_demo", "dataset_info": str(info)}])
        base = base.model_dump(mode="json")
        base["model"]["tokenizer"] = str(tokenizer)
        pixels[name] = vision_rows(load_config(None, base=base)).examples.images(0).pixels
    base["data"]["cache"] = False  # the other folder read afresh: its processor's pixels
    fresh = vision_rows(load_config(None, base=base)).examples.images(0).pixels
    assert not torch.allclose(torch.tensor(pixels["first"]), torch.tensor(fresh))
    torch.testing.assert_close(torch.tensor(pixels["other"]), torch.tensor(fresh))


def test_an_image_token_outside_the_text_vocabulary_is_read_as_transformers_reads_it(tmp_path):
    """transformers' Gemma3Model takes an image token id at or past the text vocabulary (it embeds it as the
    pad id before the image's embeddings replace it): logits with images equal its, or the folder is refused
    by name at load, never an IndexError."""
    from transformers import AutoTokenizer, Gemma3Config, Gemma3ForConditionalGeneration
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    from shardforge.errors import ModelError
    from shardforge.models import load_model
    from tests.vision import GEMMA3_TOKENS, REPO, _save_random

    tokenizer = AutoTokenizer.from_pretrained(REPO / "examples" / "data" / "tokenizer")
    tokenizer.add_special_tokens({"additional_special_tokens": GEMMA3_TOKENS})
    boi, eoi, image = tokenizer.convert_tokens_to_ids(GEMMA3_TOKENS)
    assert image == len(tokenizer) - 1
    cfg = Gemma3Config(
        text_config={"vocab_size": image, "hidden_size": 64, "intermediate_size": 128,
                     "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                     "head_dim": 16, "sliding_window": 8, "max_position_embeddings": 512,
                     "layer_types": ["sliding_attention", "full_attention"],
                     "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
                     "pad_token_id": tokenizer.pad_token_id},
        vision_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                       "num_attention_heads": 2, "image_size": 56, "patch_size": 14,
                       "vision_use_head": False},
        mm_tokens_per_image=4, boi_token_index=boi, eoi_token_index=eoi, image_token_index=image,
    )  # fmt: skip
    source = _save_random(Gemma3ForConditionalGeneration, cfg, 0.3, tmp_path / "m", tokenizer,
                          Gemma3ImageProcessorPil(size={"height": 56, "width": 56}))  # fmt: skip
    ids, images, kwargs = encode(source, SAMPLES[1])
    reference = reference_model(source)
    try:
        ours = load_model(source).eval()
    except ModelError as exc:
        assert "vocab" in str(exc), str(exc)
        return
    with torch.no_grad():
        got = ours(ids, images=images)
    torch.testing.assert_close(got, _theirs(reference, ids, kwargs), atol=1e-4, rtol=0)


def test_packing_with_a_few_image_records_among_text_is_refused_before_training(
    tmp_path, folder, monkeypatch
):
    """data.packing on Gemma 3 with images in a few records among many text ones: the run is refused before
    its first optimizer step (the data says it has images when it is read), not after steps of text rows
    when the first packed row with an image comes (hours into a real run)."""
    from shardforge.config import load_config
    from shardforge.errors import ConfigError, DataError, ModelError
    from shardforge.train import trainer
    from shardforge.train.trainer import train

    records = json.loads(
        (lf_image_dataset(tmp_path / "data", count=2)).parent.joinpath("mllm_demo.json").read_text()
    )
    text = [
        {"messages": [{"role": "user", "content": f"Plain question {i}?"},
                      {"role": "assistant", "content": "A plain answer."}], "images": []}
        for i in range(40)
    ]  # fmt: skip
    (tmp_path / "data" / "mllm_demo.json").write_text(json.dumps(text + records))
    info = tmp_path / "data" / "dataset_info.json"
    base = vision_data_config(
        tmp_path, folder, [{"name": "mllm_demo", "dataset_info": str(info)}], packing=True
    )
    base = base.model_dump(mode="json")
    base["train"] |= {"steps": 30, "micro_batch": 1}
    done = []
    step = trainer.Trainer.train_step

    def counted(self):
        out = step(self)
        done.append(1)
        return out

    monkeypatch.setattr(trainer.Trainer, "train_step", counted)
    with pytest.raises((ConfigError, DataError, ModelError), match="packing"):
        train(load_config(None, base=base))
    assert not done, f"refused after {len(done)} optimizer steps"
