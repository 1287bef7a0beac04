"""A vision-language model (tiny Qwen2-VL, images in every record) on 2 ranks equals one process, in one
launch: DDP, ZeRO-2 and ZeRO-3 (FSDP2), with LLaMA-Factory's default freezing (the tower and the projector
frozen) and with every part training."""

from __future__ import annotations

import pytest
import torch

from tests.dist._harness import run_ranks
from tests.dist._training import assert_same, parity_train, train_runs
from tests.vision import lf_image_dataset, tiny_qwen2_vl

ONE = parity_train(3, mb=2)  # 4 rows a step: 2 per micro-step x 2 accumulation
RANKS = parity_train(3, mb=1)  # ... as 1 per rank x 2 accumulation x 2 ranks
LAYOUTS = {
    "ddp": {"dp_replicate": 2, "dp_shard": 1},
    "zero2": {"dp_shard": 2, "zero_stage": 2},
    "zero3": {"dp_shard": 2, "zero_stage": 3},
}
VISION = {"frozen-tower": {}, "all-parts": {"freeze_tower": False, "freeze_projector": False}}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("vision")
    return tiny_qwen2_vl(root / "model"), lf_image_dataset(root / "data", count=8)


def _config(tmp_path, folders, name, train, vision, parallel=None):
    model, info = folders
    return {
        "output_dir": str(tmp_path / name),
        "model": {"path": str(model)},
        "data": {"train": [{"name": "mllm_demo", "dataset_info": str(info)}], "max_length": 256,
                 "packing": name.endswith("packed"), "cache_dir": str(tmp_path / "cache")},
        "method": {"vision": vision},
        "train": train,
        "parallel": parallel or {},
        "log": {"tensorboard": False, "plot": False, "progress": False},
        "checkpoint": {"save_final": False},
    }  # fmt: skip


def test_vision_language_model_on_two_ranks_equals_one_process(tmp_path, folders):
    refs = {
        v: train_runs([_config(tmp_path, folders, f"one-{v}", ONE, vision)])[0]
        for v, vision in VISION.items()
    }
    configs, names = [], []
    for v, vision in VISION.items():
        for layout, parallel in LAYOUTS.items():
            configs.append(_config(tmp_path, folders, f"{layout}-{v}", RANKS, vision, parallel))
            names.append(v)
    runs = run_ranks(train_runs, 2, configs)[0]
    for v, run in zip(names, runs, strict=True):
        assert run["layout"] != refs[v]["layout"]
        assert_same(run, refs[v], rel=1e-5, atol=1e-4)
    moved = refs["all-parts"]["state"]["visual.blocks.0.attn.qkv.weight"]
    kept = refs["frozen-tower"]["state"]["visual.blocks.0.attn.qkv.weight"]
    assert not torch.equal(moved, kept)  # the tower trained in one, not in the other
