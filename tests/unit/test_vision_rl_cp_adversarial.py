"""Adversarial checks of RL with image prompts (objectives/rollout.py) and of context parallel with images
(parallel/images.py, context_parallel.split_batch): on one process, each cp rank's part of a batch places
exactly the whole rows' image embeddings and positions at its indices, whatever the images straddle; the
rollout scores completions as the engine sampled them on inputs the happy path does not reach; what the
rollout cannot read is said by name."""

from __future__ import annotations

import pytest
import torch

from shardforge.data.batching import IGNORE, Batch
from shardforge.models.common.images import ImageInputs
from tests.unit.test_vision_language import FAMILIES as ALL_FAMILIES
from tests.vision import (
    lf_image_dataset,
    mixed_image_dataset,
    random_image,
    sharegpt_info,
    tiny_qwen2_vl,
)

FAMILIES = {k: make for k, make in ALL_FAMILIES.items() if k != "gemma3"}  # ours: context parallel


@pytest.fixture(scope="module", params=list(FAMILIES))
def folder(request, tmp_path_factory):
    return FAMILIES[request.param](tmp_path_factory.mktemp(request.param))


# ---- context parallel: split_batch / local_images on a synthetic batch ------------------------------------
def _rows(folder, multiple: int = 4):
    """A micro-batch of three rows as collate lays them out (`doc_ids` for all, since one row is packed):
    row 0 a sample with two images of different sizes, preceded by text so that an image's run straddles
    the 2 x cp chunk boundaries; row 1 text alone (no image); row 2 two documents packed, each with an
    image (positions restart at the second). Its images in row-major order, with per-row counts."""
    from tests.unit.test_vision_language import encode

    two, two_images, _ = encode(folder, ((112, 56), (60, 90)), seed=0)
    one, one_image, _ = encode(folder, ((56, 84),), seed=5)
    text, _, _ = encode(folder, ())
    lead = torch.arange(3, 3 + 7)  # text before the first image: shifts its run over a chunk boundary
    docs = [[torch.cat([lead, two[0]])], [text[0]], [one[0], two[0]]]
    width = max(sum(len(d) for d in row) for row in docs)
    width = -(-width // multiple) * multiple
    ids = torch.zeros(3, width, dtype=torch.long)
    positions = torch.zeros(3, width, dtype=torch.long)
    doc_ids = torch.full((3, width), -1, dtype=torch.long)
    for r, row in enumerate(docs):
        col = 0
        for d, doc in enumerate(row):
            ids[r, col : col + len(doc)] = doc
            positions[r, col : col + len(doc)] = torch.arange(len(doc))
            doc_ids[r, col : col + len(doc)] = d
            col += len(doc)
    targets = torch.full_like(ids, IGNORE)
    targets[:, :-1] = torch.where(doc_ids[:, 1:] >= 0, ids[:, 1:], IGNORE)
    per_row = [[two_images], [], [one_image, two_images]]
    found = [im for row in per_row for im in row]
    images = ImageInputs(
        torch.cat([im.pixel_values for im in found]),
        torch.cat([im.grid_thw for im in found]),
        rows=torch.tensor(
            [[sum(len(im.grid_thw) for im in r), sum(len(im.pixel_values) for im in r)] for r in per_row]
        ),
    )
    batch = Batch(ids, targets, positions, doc_ids, int((doc_ids >= 0).sum()), 0, images=images)
    return batch


def test_cp_ranks_place_exactly_the_whole_rows_images_at_their_indices(folder):
    """For cp = 2 and 4, each rank's part (split_batch with the model) embeds its tokens exactly as the whole
    rows' embedding does at its indices (the tower's embeddings it keeps in the slots it holds, an image
    that straddles ranks cut where its tokens are), its rotary positions (M-RoPE's, or the tokens') are
    the whole rows' at its indices, Qwen3-VL's deepstack features are added at the same tokens, and the
    ranks' kept image tokens together are every image token once."""
    from shardforge.models import load_model
    from shardforge.parallel.context_parallel import local_indices, split_batch
    from shardforge.parallel.images import placed

    model = load_model(folder).eval()
    for cp in (2, 4):
        batch = _rows(folder, multiple=2 * cp)
        whole = placed(model, batch).images
        assert whole.slots.sum() > 0
        with torch.no_grad():
            embedded = model.encode_images(whole)
            h = model.embed(batch.input_ids, embedded)
            deep = model.after_block(0, h, batch.input_ids, embedded)
        seq = batch.input_ids.shape[1]
        kept = torch.zeros(int(whole.slots.sum()), dtype=torch.long)
        straddles = False
        for rank in range(cp):
            index = local_indices(seq, cp, rank)
            part = split_batch(batch, cp, rank, model)
            assert torch.equal(part.input_ids, batch.input_ids[:, index])
            assert torch.equal(part.position_ids, batch.position_ids[:, index])
            assert torch.equal(part.images.positions, whole.positions[..., index])
            assert torch.equal(part.images.slots, whole.slots[:, index])
            assert part.images.keep is not None
            assert int(part.images.keep.sum()) == int(part.images.slots.sum())
            kept += part.images.keep.long()
            held = int(part.images.slots.sum())
            straddles |= 0 < held < int(whole.slots.sum())
            with torch.no_grad():
                mine = model.encode_images(part.images)
                local = model.embed(part.input_ids, mine)
                local_deep = model.after_block(0, local, part.input_ids, mine)
            torch.testing.assert_close(local, h[:, index], rtol=0, atol=0)
            torch.testing.assert_close(local_deep, deep[:, index], rtol=0, atol=0)
        assert straddles and torch.equal(kept, torch.ones_like(kept))


def test_cp_split_of_a_batch_whose_image_run_crosses_a_chunk_edge_has_its_tokens_on_both_ranks(tmp_path):
    """Qwen2-VL: an image whose tokens run over the boundary of chunk 0 and 1 (rank 0 holds the head of the
    run, rank 1 its tail): each rank's M-RoPE positions of its part of the run are the whole run's (the
    grid's height and width, not restarted), and the two parts' embeddings are the image's in order."""
    from shardforge.models import load_model
    from shardforge.parallel.context_parallel import local_indices, split_batch
    from shardforge.parallel.images import placed

    folder = tiny_qwen2_vl(tmp_path / "model")
    model = load_model(folder).eval()
    batch = _rows(folder, multiple=4)
    seq = batch.input_ids.shape[1]
    token = model.config.image_token_id
    row = batch.input_ids[0]
    run = (row == token).nonzero().squeeze(1)
    chunk = seq // 4
    crossing = [b for b in (chunk, 2 * chunk, 3 * chunk) if run.min() < b <= run.max()]
    assert crossing, "the synthetic row must put an image over a chunk edge"
    whole = placed(model, batch).images
    with torch.no_grad():
        all_embeddings = model.image_embeddings(whole, torch.float32)
    by_index = {}
    for rank in range(2):
        index = local_indices(seq, 2, rank)
        part = split_batch(batch, 2, rank, model)
        with torch.no_grad():
            mine = model.encode_images(part.images).embeddings
        slots = part.images.slots.nonzero()
        assert len(slots) == len(mine)
        for (r, j), e in zip(slots.tolist(), mine, strict=True):
            by_index[(r, int(index[j]))] = e
    order = whole.slots.nonzero().tolist()
    placed_in_order = torch.stack([by_index[tuple(k)] for k in order])
    torch.testing.assert_close(placed_in_order, all_embeddings, rtol=0, atol=0)


# ---- RL with image prompts ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    return mixed_image_dataset(tmp_path_factory.mktemp("prompts"))


def _spy_rollouts(monkeypatch):
    """Records each rollout's prompts, images and completions (the sampler's) and each micro-batch's
    reference log-probs at its targets (sequence after sequence, as the sampler's)."""
    from shardforge.objectives.rl import GRPOObjective
    from shardforge.train.sampler import TrainingSampler

    rollouts, references = [], []
    sample, score = TrainingSampler.sample, GRPOObjective._score_reference

    def spy_sample(self, ids, positions, images):
        out = sample(self, ids, positions, images)
        rollouts.append((ids, images, out))
        references.append([])
        return out

    def spy_reference(self, model, batch, mask, forward):
        score(self, model, batch, mask, forward)
        references[-1].append(batch.extras["ref_logps"][mask].detach().cpu())

    monkeypatch.setattr(TrainingSampler, "sample", spy_sample)
    monkeypatch.setattr(GRPOObjective, "_score_reference", spy_reference)
    return rollouts, references


def _transformers_logps(reference, family, prompt, completion, pictures):
    from tests.unit.test_vision_rollouts import theirs_inputs

    full = torch.tensor([prompt + completion])
    token = reference.config.image_token_id
    with torch.no_grad():
        logits = reference(input_ids=full, **theirs_inputs(family, full, pictures, token)).logits
    logps = torch.log_softmax(logits[0, len(prompt) - 1 : -1].float(), -1)
    return logps.gather(-1, torch.tensor(completion)[:, None])[:, 0]


@pytest.mark.parametrize("finetuning", ["lora", "full"])
def test_kl_reference_of_image_prompts_is_the_starting_model_as_transformers_scores_it(
    tmp_path, prompts, monkeypatch, finetuning
):
    """kl_beta > 0 with the tower training (LoRA on the tower: the reference is the model with its
    adapters disabled; full: a frozen copy): on the second step, after an update, the reference log-probs
    the KL term reads for each completion of an image prompt equal transformers' starting model's on the
    same prompt, images and completion."""
    from shardforge.train.trainer import train
    from tests.unit.test_vision_language import reference_model
    from tests.unit.test_vision_rollouts import rl_config

    folder = tiny_qwen2_vl(tmp_path / "model")
    config = rl_config(tmp_path, folder, prompts, steps=2)
    if finetuning == "lora":
        config.method.finetuning = "lora"
        config.method.lora.targets = "all"
        config.method.vision.freeze_projector = True  # LoRA does not reach it (refused unfrozen)
    rollouts, references = _spy_rollouts(monkeypatch)
    history = train(config).history
    assert history[1]["kl"] > 0  # the policy moved: the reference is not the policy
    reference = reference_model(folder)
    ids, images, groups = rollouts[1]
    flat = torch.cat(references[1])
    at = compared = 0
    for prompt, pictures, completions in zip(ids, images, groups, strict=True):
        for c in completions:
            n = len(c.tokens)
            ours = flat[at : at + n]
            at += n
            if reference.config.image_token_id in c.tokens:
                continue
            theirs = _transformers_logps(reference, "qwen2_vl", prompt, c.tokens, pictures)
            torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)
            compared += pictures is not None
    assert at == len(flat) and compared >= 2


def _prompt_set(folder, records: list[dict]):
    """A dataset_info.json (entry "mllm_demo") of sharegpt `records` in `folder`, images relative to it."""
    import json

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "p.json").write_text(json.dumps(records))
    return sharegpt_info(folder, "p.json")


def _boost_image_token(folder, strength: float = 6.0) -> None:
    """The saved model's output row of the image token turned toward its typical final hidden state, so
    that sampling at temperature 1 draws the image token in a good share of completions."""
    from safetensors.torch import load_file, save_file

    from tests.unit.test_vision_language import reference_model

    reference = reference_model(folder)
    with torch.no_grad():
        hidden = reference(
            input_ids=torch.randint(0, 900, (4, 64), generator=torch.Generator().manual_seed(0)),
            output_hidden_states=True,
        ).hidden_states[-1]
    mean = hidden.reshape(-1, hidden.shape[-1]).mean(0)
    state = load_file(folder / "model.safetensors")
    key = next(k for k in state if k.endswith("lm_head.weight"))
    state[key][reference.config.image_token_id] = strength * mean / mean.norm() ** 2
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize("stage", ["grpo", "ppo"])  # the shared prompt; one sequence a row
def test_completions_that_sample_the_image_token_are_scored_as_the_engine_sampled_them(
    tmp_path, prompts, monkeypatch, stage
):
    """Qwen2-VL with completions that often draw the image token (after a prompt with images, and after
    one without): the training forward reads it as a token, with M-RoPE's text positions after the prompt,
    as the engine did: its log-probs equal the engine's on the first step."""
    from shardforge.train.trainer import train
    from tests.unit.test_vision_rollouts import rl_config

    folder = tiny_qwen2_vl(tmp_path / "model")
    _boost_image_token(folder)
    rollouts, _ = _spy_rollouts(monkeypatch)
    history = train(rl_config(tmp_path, folder, prompts, stage=stage, steps=2)).history
    from transformers import AutoConfig

    image_token = AutoConfig.from_pretrained(folder).image_token_id
    drawn = [
        (pictures is not None, image_token in c.tokens)
        for _, images, groups in rollouts
        for pictures, group in zip(images, groups, strict=True)
        for c in group
    ]
    assert any(p and t for p, t in drawn), "no completion of an image prompt drew the image token"
    for h in history:
        assert h["logprob_delta"] < 1e-5, h["logprob_delta"]


def test_prompts_too_long_once_their_images_are_expanded_are_counted_too_long(tmp_path, prompts):
    """A prompt of a few words whose two images expand to many image tokens does not fit `room` and is
    counted too long (not kept, not a crash), while the text prompts and the short image prompts are kept;
    none fitting is a DataError."""
    from transformers import AutoTokenizer

    from shardforge.errors import DataError
    from shardforge.objectives import build_objective, reading_of
    from shardforge.objectives.rollout import load_prompts
    from tests.unit.test_vision_rollouts import rl_config

    folder = tiny_qwen2_vl(tmp_path / "model")
    config = rl_config(tmp_path, folder, prompts)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    reader = _reader(config, tokenizer)
    how = reading_of(build_objective(config.method))
    kept, too_long = load_prompts(config.data, tokenizer, 200, how, reader)
    longest = max(len(p.ids) for p in kept)
    kept, too_long = load_prompts(config.data, tokenizer, longest - 1, how, reader)
    assert too_long == 1 and all(len(p.ids) < longest for p in kept)
    assert any(p.record.images for p in kept) and any(not p.record.images for p in kept)
    with pytest.raises(DataError, match="none of the 7 prompts fits"):
        load_prompts(config.data, tokenizer, 5, how, reader)


def _reader(config, tokenizer):
    """The run's image reader (data/build.py's)."""
    from shardforge.data.build import record_images

    return record_images(config, tokenizer, config.data)[0]


def test_load_prompts_does_not_hold_every_prompt_s_images_at_once(tmp_path, monkeypatch):
    """load_prompts reads each image for its token count only: the rollouts read them again, "with only
    the step's prompts in memory". Twelve image prompts must not all have their pixel arrays alive at once
    while the prompts are loaded (a data set of many images would need them all in memory at startup)."""
    import gc
    import weakref

    from transformers import AutoTokenizer

    from shardforge.objectives import build_objective, reading_of, rollout
    from tests.unit.test_vision_rollouts import rl_config

    info = lf_image_dataset(tmp_path / "data", count=12)
    folder = tiny_qwen2_vl(tmp_path / "model")
    config = rl_config(tmp_path, folder, info)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    alive, peak = [], [0]
    read = rollout.with_images

    def counted(record, *args):
        out = read(record, *args)
        if out[1] is not None:
            alive.append(weakref.ref(out[1].pixels))
        gc.collect()
        peak[0] = max(peak[0], sum(r() is not None for r in alive))
        return out

    monkeypatch.setattr(rollout, "with_images", counted)
    prompts, _ = rollout.load_prompts(
        config.data, tokenizer, 200, reading_of(build_objective(config.method)), _reader(config, tokenizer)
    )
    assert len(prompts) == 12
    assert peak[0] <= 2, f"{peak[0]} prompts' pixel arrays alive at once while loading 12"


@pytest.mark.parametrize("family", ["qwen2_vl", "llava_next"])
def test_a_prompt_image_replaced_after_loading_is_refused_naming_its_record(tmp_path, monkeypatch, family):
    """The rollout reads a prompt's images again; where one was replaced (after the prompts were loaded)
    by an image of another size, its image tokens in the prompt no longer match: the error names the
    record and says its images do not match the prompt (not the engine's or M-RoPE's 'expand each mark')."""
    from shardforge.errors import ShardforgeError
    from shardforge.objectives import rollout
    from shardforge.train.trainer import train
    from tests.unit.test_vision_rollouts import rl_config

    folder = FAMILIES[family](tmp_path / "model")
    info = lf_image_dataset(tmp_path / "data", count=2)
    load = rollout.load_prompts

    def then_replace(*args, **kwargs):
        out = load(*args, **kwargs)
        for i in range(2):
            random_image(200, 300, seed=i).save(tmp_path / "data" / "mllm_demo_data" / f"{i}.png")
        return out

    monkeypatch.setattr(rollout, "load_prompts", then_replace)
    with pytest.raises(
        ShardforgeError, match=r"record \d \(line \d+\): its images make \d+ image tokens now .* changed"
    ):
        train(rl_config(tmp_path, folder, info, steps=1))


@pytest.mark.parametrize("family", ["llava", "llava_next"])
def test_grpo_prompt_ending_in_its_image_tokens_trains_with_the_prompt_shared(tmp_path, family):
    """LLaVA's image prompt is its image tokens alone: with a chat template that adds nothing after the
    user's turn, a prompt "... <image>" ends in an image token. GRPO shares the prompt over its group's
    completions (collate_groups: each completion led by the prompt's last token); the training forward must
    still place each image once per prompt as the engine did (logprob_delta ~1e-7), not crash counting
    the repeated last token as an image token of every completion."""
    from shardforge.train.trainer import train
    from tests.unit.test_vision_rollouts import rl_config

    folder = FAMILIES[family](tmp_path / "model")
    (folder / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    data = tmp_path / "data"
    data.mkdir()
    records = []
    for i in range(2):
        random_image(56, 84, seed=i).save(data / f"{i}.png")
        messages = [
            {"role": "user", "content": f"Picture {i}: <image>"},
            {"role": "assistant", "content": "ok"},
        ]
        records.append({"messages": messages, "images": [f"{i}.png"]})
    history = train(rl_config(tmp_path, folder, _prompt_set(data, records), steps=1)).history
    assert history[0]["logprob_delta"] < 1e-5


@pytest.mark.parametrize("stage", ["grpo", "ppo"])
def test_a_text_prompt_that_spells_the_image_token_is_scored_as_the_engine_sampled_it(tmp_path, stage):
    """Qwen2-VL: a prompt without images whose text holds "<|image_pad|>" (the image token's spelling) is
    sampled by the engine with the token as a token (no images), but a training forward with image prompts
    beside it would count it among the images' tokens: refused by record when the prompts are loaded, as
    such a record is for any stage."""
    import json

    from shardforge.errors import DataError
    from shardforge.train.trainer import train
    from tests.unit.test_vision_rollouts import rl_config

    folder = tiny_qwen2_vl(tmp_path / "model")
    info = lf_image_dataset(tmp_path / "data", count=3)
    path = tmp_path / "data" / "mllm_demo.json"
    records = json.loads(path.read_text())
    messages = [
        {"role": "user", "content": "What does <|image_pad|> mean?"},
        {"role": "assistant", "content": "A token."},
    ]
    path.write_text(json.dumps([*records, {"messages": messages, "images": []}]))
    with pytest.raises(
        DataError, match=r"record 3 \(line 1\): its text holds the model.s image token 1 time"
    ):
        train(rl_config(tmp_path, folder, info, stage=stage, steps=2))  # refused when loaded, by record


@pytest.mark.parametrize(
    "rl", [{"group_size": 1}, {"epochs_per_rollout": 2}], ids=["group-of-one", "two-epochs-per-rollout"]
)
def test_image_rollouts_with_a_group_of_one_or_several_epochs(tmp_path, prompts, rl):
    """GRPO on the mixed prompts with a group of one (no advantage: loss 0) or two epochs per rollout (the
    second step trains the cached rollout, images and all, against its old log-probs): the first step's
    training forward equals the engine and every loss is finite."""
    from shardforge.train.trainer import train
    from tests.unit.test_vision_rollouts import rl_config

    config = rl_config(tmp_path, tiny_qwen2_vl(tmp_path / "model"), prompts, steps=3)
    for key, value in rl.items():
        setattr(config.method.rl, key, value)
    history = train(config).history
    assert history[0]["logprob_delta"] < 1e-5
    assert all(torch.isfinite(torch.tensor(h["loss"])) for h in history)
    if rl.get("group_size") == 1:
        assert all(h["loss"] == 0 for h in history)
    else:
        assert history[2]["logprob_delta"] < 1e-5  # a fresh rollout
        assert history[1]["ratio"] != 1.0  # the cached rollout trained again, on moved weights


@pytest.mark.parametrize("damage", ["deleted", "corrupt"])
def test_a_prompt_image_deleted_or_corrupted_after_loading_is_a_data_error_naming_it(
    tmp_path, monkeypatch, damage
):
    """The rollout reads a prompt's images again: one deleted or overwritten with garbage after the
    prompts were loaded is a DataError naming the record and the file, not a traceback."""
    from shardforge.errors import DataError
    from shardforge.objectives import rollout
    from shardforge.train.trainer import train
    from tests.unit.test_vision_rollouts import rl_config

    folder = tiny_qwen2_vl(tmp_path / "model")
    info = lf_image_dataset(tmp_path / "data", count=2)
    images = tmp_path / "data" / "mllm_demo_data"
    load = rollout.load_prompts

    def then_damage(*args, **kwargs):
        out = load(*args, **kwargs)
        for path in images.iterdir():
            path.unlink() if damage == "deleted" else path.write_bytes(b"not an image")
        return out

    monkeypatch.setattr(rollout, "load_prompts", then_damage)
    with pytest.raises(DataError, match=r"record \d.*cannot read image .*mllm_demo_data"):
        train(rl_config(tmp_path, folder, info, steps=1))
