"""The generic backend (transformers' modules) under data parallel: DDP, ZeRO-1, ZeRO-2, FSDP2 ZeRO-3
(sharded per decoder layer) and ZeRO-3 with activation checkpointing, on 2 ranks, equal one process for two
families built tiny in the test (one launch for all)."""

from __future__ import annotations

import pytest

from tests.dist._harness import run_ranks
from tests.dist._training import assert_same, train_runs
from tests.unit.test_generic_backend import _train_config, hf_folder

DATA = {"max_length": 48}
ONE = {"micro_batch": 2, "grad_accum": 2}  # 4 rows a step, as 1 per rank x 2 accumulation x 2 ranks
RANKS = {"micro_batch": 1, "grad_accum": 2}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("generic")
    return {name: hf_folder(root, name) for name in ("gemma2", "olmo2")}


def test_generic_backend_on_two_ranks_equals_one_process(tmp_path, folders):
    layouts = {
        "ddp": {"dp_replicate": 2, "dp_shard": 1},
        "zero1": {"dp_replicate": 2, "dp_shard": 1, "zero_stage": 1},
        "zero2": {"dp_shard": 2, "zero_stage": 2},
        "zero3": {"dp_shard": 2, "zero_stage": 3},
        "zero3-ckpt": {"dp_shard": 2, "zero_stage": 3, "activation_checkpoint": "full"},
    }
    refs = {
        name: train_runs([_train_config(tmp_path, folder, f"one-{name}", data=DATA, train=ONE)])[0]
        for name, folder in folders.items()
    }
    configs, names = [], []
    for family, folder in folders.items():
        for layout, parallel in layouts.items():
            name = f"{family}-{layout}"
            configs.append(_train_config(tmp_path, folder, name, parallel=parallel, data=DATA, train=RANKS))
            names.append(family)
    runs = run_ranks(train_runs, 2, configs)[0]
    for family, run in zip(names, runs, strict=True):
        assert run["layout"] != refs[family]["layout"]
        assert_same(run, refs[family], rel=1e-5, atol=1e-4)
