"""The generic backend (transformers' modules) on 2 ranks, for five families built tiny in the test (one
launch): DDP and FSDP2 ZeRO-3 (sharded per decoder layer) equal one process for all; ZeRO-1, ZeRO-2, ZeRO-3
with activation checkpointing or optimizer offload, and TP2 (transformers' plan of the family: OLMo 2's
gathered q/k projections too) for Gemma 2 and OLMo 2; HSDP on 4 ranks; a checkpoint saved by ZeRO-3 on 2
ranks resumes in one process."""

from __future__ import annotations

import pytest

from shardforge.config import load_config
from shardforge.train.trainer import Trainer
from tests.dist._harness import run_ranks
from tests.dist._training import assert_same, logged_losses, stopped_at, train_runs
from tests.unit.test_generic_backend import _train_config, hf_folder

DATA = {"max_length": 48}
ONE = {"micro_batch": 2, "grad_accum": 2}  # 4 rows a step, as 1 per rank x 2 accumulation x 2 ranks
RANKS = {"micro_batch": 1, "grad_accum": 2}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("generic")
    return {name: hf_folder(root, name) for name in ("gemma2", "glm4", "granite", "olmo2", "phi3")}


def test_generic_backend_on_two_ranks_equals_one_process(tmp_path, folders):
    layouts = {
        "ddp": {"dp_replicate": 2, "dp_shard": 1},
        "zero1": {"dp_replicate": 2, "dp_shard": 1, "zero_stage": 1},
        "zero2": {"dp_shard": 2, "zero_stage": 2},
        "zero3": {"dp_shard": 2, "zero_stage": 3},
        "zero3-ckpt": {"dp_shard": 2, "zero_stage": 3, "activation_checkpoint": "full"},
        "tp2": {"tp": 2, "dp_shard": 1, "sequence_parallel": False},  # transformers' plan of the family
        "zero3-offload": {"dp_shard": 2, "zero_stage": 3, "offload": "optimizer"},
    }
    refs = {
        name: train_runs([_train_config(tmp_path, folder, f"one-{name}", data=DATA, train=ONE)])[0]
        for name, folder in folders.items()
    }
    configs, names = [], []
    for family, folder in folders.items():
        # every layout on two families; DDP and ZeRO-3 on the others
        chosen = layouts if family in ("gemma2", "olmo2") else {k: layouts[k] for k in ("ddp", "zero3")}
        for layout, parallel in chosen.items():
            name = f"{family}-{layout}"
            train = ONE if parallel.get("tp") else RANKS  # no data parallel under tp2: 2 x 2 rows per rank
            configs.append(_train_config(tmp_path, folder, name, parallel=parallel, data=DATA, train=train))
            names.append(family)
    runs = run_ranks(train_runs, 2, configs)[0]
    for family, run in zip(names, runs, strict=True):
        assert run["layout"] != refs[family]["layout"]
        assert_same(run, refs[family], rel=1e-5, atol=1e-4)


@pytest.mark.parametrize("family", ["gemma2", "phi3"])
def test_a_generic_checkpoint_resumes_on_another_layout(tmp_path, folders, family):
    """Saved by FSDP2 ZeRO-3 on 2 ranks (DCP, sharded per decoder layer), resumed in one process: the
    steps after the checkpoint have the losses of a run that was never stopped."""
    sections = {"data": DATA, "checkpoint": {"every": 2, "save_final": False}}
    straight = _train_config(tmp_path, folders[family], "straight", train={**ONE, "steps": 4}, **sections)
    whole = [r["loss"] for r in Trainer(load_config(None, base=straight)).train().history]
    sharded = _train_config(tmp_path, folders[family], "resumed", train={**RANKS, "steps": 4},
                            parallel={"dp_shard": 2, "zero_stage": 3}, **sections)  # fmt: skip
    run_ranks(stopped_at, 2, sharded, 2)
    resumed = _train_config(tmp_path, folders[family], "resumed", train={**ONE, "steps": 4}, **sections)
    trainer = Trainer(load_config(None, base=resumed))
    trainer.train()
    assert trainer.start_step == 2
    assert logged_losses(tmp_path / "resumed" / "run") == pytest.approx(whole, rel=1e-5)


def test_generic_backend_under_hsdp_equals_one_process(tmp_path, folders):
    """HSDP on 4 ranks: replicated over 2 groups, sharded over 2 ranks in each."""
    ref = train_runs([_train_config(tmp_path, folders["olmo2"], "one", data=DATA, train=ONE)])[0]
    hsdp = {"dp_replicate": 2, "dp_shard": 2, "zero_stage": 3}
    train = {"micro_batch": 1, "grad_accum": 1}  # 1 x 1 x 4 ranks = the 4 rows of one process's step
    cfg = _train_config(tmp_path, folders["olmo2"], "hsdp", parallel=hsdp, data=DATA, train=train)
    run = run_ranks(train_runs, 4, [cfg])[0][0]
    assert "dp_replicate=2" in run["layout"]
    assert_same(run, ref, rel=1e-5, atol=1e-4)
