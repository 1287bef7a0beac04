"""RL with image prompts (grpo, ppo): the rollout engine samples each prompt with its images, whose
log-probs equal transformers' on the same prompt, images and completion; the training forward scores the
rollout as the engine sampled it (the prompt shared by its group's completions, Qwen2-VL's M-RoPE positions
of the completions after the prompt, a completion's token that happens to be the image token read as a
token), so the two agree to ~1e-7; what the engine cannot place yet is refused by name."""

from __future__ import annotations

import pytest
import torch

from shardforge.errors import ConfigError
from shardforge.train.sampler import TrainingSampler
from tests.unit.test_vision_language import reference_model
from tests.vision import mixed_image_dataset, tiny_llava, tiny_qwen2_vl, tiny_qwen3_vl

FAMILIES = {"qwen2_vl": tiny_qwen2_vl, "llava": tiny_llava, "qwen3_vl": tiny_qwen3_vl}
SLOW = {"llava", "qwen3_vl"}  # the quick tier keeps Qwen2-VL (M-RoPE, the shared prompt)


def rl_config(tmp_path, model, info, stage="grpo", steps=1, **parallel):
    """GRPO (or PPO) on LF's multimodal demo prompts (some with one or two images, some with none), every
    part of the model training, completions scored by a reward that differs between them."""
    from shardforge.config import load_config

    return load_config(None, base={
        "model": {"path": str(model)},
        "method": {"stage": stage, "vision": {"freeze_tower": False, "freeze_projector": False},
                   "rl": {"group_size": 4, "max_new_tokens": 6, "temperature": 1.0, "kl_beta": 0.1,
                          "rewards": [{"name": "tests.dist.test_rl_layouts:digit_share"}]}},
        "data": {"train": [{"name": "mllm_demo", "dataset_info": str(info)}], "max_length": 256,
                 "cache_dir": str(tmp_path / "cache")},
        "train": {"steps": steps, "micro_batch": 2, "lr": 1e-3, "warmup": 0, "log_every": 1},
        "parallel": parallel,
        "log": {"tensorboard": False, "plot": False, "progress": False},
        "checkpoint": {"save_final": False},
        "output_dir": str(tmp_path / "run"),
    })  # fmt: skip


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    return mixed_image_dataset(tmp_path_factory.mktemp("prompts"))


def theirs_inputs(model_type: str, ids: torch.Tensor, images, image_token: int) -> dict:
    """transformers' forward inputs for a prompt's images as our rollout hands them to the engine."""
    if images is None:
        return {}
    count = len(images.grid_thw)
    if model_type == "llava":  # whole resized images, one per row, (1, h, w) in 14-pixel patches
        _, h, w = images.grid_thw[0].tolist()
        return {"pixel_values": images.pixel_values.view(count, 3, h * 14, w * 14)}
    if model_type == "gemma3":  # square images, one per row; its image tokens attend both ways
        side = int((images.pixel_values.shape[1] // 3) ** 0.5)
        pixels = images.pixel_values.view(count, 3, side, side)
        return {"pixel_values": pixels, "token_type_ids": (ids == image_token).long()}
    mm = (ids == image_token).int()
    return {"pixel_values": images.pixel_values, "image_grid_thw": images.grid_thw, "mm_token_type_ids": mm}


def spied_rollouts(monkeypatch) -> list:
    """Every rollout the run samples, as (prompts' ids, their images, their completions)."""
    captured = []
    sample = TrainingSampler.sample

    def spy(self, ids, positions, images):
        out = sample(self, ids, positions, images)
        captured.append((ids, images, out))
        return out

    monkeypatch.setattr(TrainingSampler, "sample", spy)
    return captured


def compare_first_rollout(captured: list, reference, model_type: str) -> tuple[int, int]:
    """The first rollout's (the starting weights') engine log-probs against transformers' on each prompt,
    its images and completion; returns how many completions were compared, and how many with images. A
    completion holding the image token is left out where its prompt has images (transformers would take it
    for an image's)."""
    token = reference.config.image_token_id
    compared = with_images = 0
    ids, images, groups = captured[0]
    for prompt, pictures, completions in zip(ids, images, groups, strict=True):
        for c in completions:
            if token in c.tokens and pictures is not None:
                continue
            full = torch.tensor([prompt + c.tokens])
            with torch.no_grad():
                logits = reference(input_ids=full, **theirs_inputs(model_type, full, pictures, token)).logits
            theirs = torch.log_softmax(logits[0, len(prompt) - 1 : -1].float(), -1)
            theirs = theirs.gather(-1, torch.tensor(c.tokens)[:, None])[:, 0]
            torch.testing.assert_close(torch.tensor([lp for lp, _ in c.logprobs]), theirs, atol=1e-4, rtol=0)
            compared += 1
            with_images += pictures is not None
    return compared, with_images


@pytest.mark.parametrize(
    "family", [pytest.param(f, marks=[pytest.mark.slow] if f in SLOW else []) for f in FAMILIES]
)
def test_rollouts_with_images_are_sampled_and_scored_as_transformers_scores_them(
    tmp_path, prompts, family, monkeypatch
):
    from shardforge.train.trainer import train

    folder = FAMILIES[family](tmp_path / family)
    captured = spied_rollouts(monkeypatch)
    history = train(rl_config(tmp_path, folder, prompts, steps=2)).history
    # the training forward (shared prompts, the engine's placement of the images) equals the engine's
    assert history[0]["logprob_delta"] < 1e-5
    assert all(torch.isfinite(torch.tensor(h["loss"])) for h in history)
    ids, images, _ = captured[0]
    assert len(ids) == 2 and any(im is not None for im in images)
    compared, with_images = compare_first_rollout(captured, reference_model(folder), family)
    assert compared >= 4 and with_images >= 2


def test_ppo_with_a_value_head_takes_image_prompts(tmp_path, prompts):
    from shardforge.train.trainer import train

    folder = tiny_qwen2_vl(tmp_path / "model")
    history = train(rl_config(tmp_path, folder, prompts, stage="ppo")).history
    assert history[0]["logprob_delta"] < 1e-5  # one sequence a row: positions from the model's own layout


def test_what_the_rollout_engine_cannot_place_is_refused_by_name(tmp_path, prompts):
    from shardforge.config.parallel_schema import ParallelSection
    from shardforge.objectives import build_objective
    from shardforge.objectives.rollout import check_image_rollouts
    from shardforge.parallel.dims import ParallelDims

    config = rl_config(tmp_path, tmp_path, prompts, stage="ppo")
    critic = config.model_copy(update={"method": config.method.model_copy(deep=True)})
    critic.method.ppo.critic = str(tmp_path)
    with pytest.raises(ConfigError, match=r"parallel\.pp=2: the prompts have images"):
        check_image_rollouts(
            build_objective(config.method), ParallelDims.from_config(ParallelSection(pp=2, dp_shard=1), 2)
        )
    with pytest.raises(ConfigError, match=r"method\.ppo\.critic=.*separate critic model reads the tokens"):
        check_image_rollouts(build_objective(critic.method), ParallelDims.from_config(ParallelSection(), 1))
