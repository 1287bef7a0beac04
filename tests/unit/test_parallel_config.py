"""Layout validation happens before any process group exists, with messages that show the numbers."""

from __future__ import annotations

import pytest

from shardforge.config import load_config
from shardforge.config.parallel_schema import ParallelSection
from shardforge.errors import ConfigError
from shardforge.parallel.dims import ParallelDims
from shardforge.planner.layout import resolve_grad_accum
from tests.conftest import tiny_config


def test_auto_dp_fills_the_world():
    assert ParallelDims.from_config(ParallelSection(zero_stage=0), 4).dp_replicate == 4
    z3 = ParallelDims.from_config(ParallelSection(zero_stage=3), 4)
    assert (z3.dp_replicate, z3.dp_shard, z3.dp) == (1, 4, 4)
    hsdp = ParallelDims.from_config(ParallelSection(zero_stage=2, dp_replicate=2), 4)
    assert (hsdp.dp_replicate, hsdp.dp_shard) == (2, 2) and "HSDP" in hsdp.describe()


def test_degrees_that_do_not_multiply_to_the_world():
    with pytest.raises(ConfigError, match=r"dp_replicate \(2\) x dp_shard \(3\) .* = 6, but 4 processes"):
        ParallelDims.from_config(ParallelSection(zero_stage=3, dp_replicate=2, dp_shard=3), 4)


def test_sharded_degree_needs_a_sharded_stage():
    with pytest.raises(ConfigError, match=r"use parallel\.dp_replicate"):
        ParallelDims.from_config(ParallelSection(zero_stage=1, dp_shard=2), 2)


def test_global_batch_not_divisible_by_dp(tmp_path):
    cfg = load_config(
        None, base=tiny_config(tmp_path, tmp_path / "x.jsonl", train={"global_batch": 6, "micro_batch": 2})
    )
    assert resolve_grad_accum(cfg, 1) == 3
    with pytest.raises(
        ConfigError,
        match=r"global_batch=6 is not divisible by train.micro_batch \(2\) x "
        r"data-parallel size \(2\) = 4",
    ):
        resolve_grad_accum(cfg, 2)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("parallel.offload=params", "offload=params needs sharded states: set parallel.zero_stage to 2 or 3"),
        ("parallel.grad_compression=fp16", None),
        ("parallel.backend=mpi2", "parallel.backend = 'mpi2'"),
        ("parallel.cp_mode=ring", "parallel.cp_mode = 'ring'"),
    ],
)
def test_bad_parallel_settings(tmp_path, override, message):
    base = tiny_config(tmp_path, tmp_path / "x.jsonl")
    if message is None:  # compression is fine with DDP, refused with FSDP
        load_config(None, [override], base=base)
        with pytest.raises(ConfigError, match=r"needs parallel\.zero_stage 0 or 1"):
            load_config(None, [override, "parallel.zero_stage=3"], base=base)
        return
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_config(None, [override], base=base)


def test_uneven_world_and_replication_only_sharding_are_refused():
    with pytest.raises(ConfigError, match=r"3 processes cannot be split evenly: dp_replicate \(2\)"):
        ParallelDims.from_config(ParallelSection(zero_stage=3, dp_replicate=2), 3)
    with pytest.raises(ConfigError, match="shards nothing"):
        ParallelDims.from_config(ParallelSection(zero_stage=2, dp_replicate=2), 2)


def test_offload_in_one_process_is_refused_before_anything_starts(tmp_path):
    from shardforge.train.trainer import Trainer

    cfg = load_config(
        None,
        ["parallel.zero_stage=3", "parallel.offload=params"],
        base=tiny_config(tmp_path, tmp_path / "x.jsonl"),
    )
    with pytest.raises(ConfigError, match="needs several processes"):
        Trainer(cfg).setup()


def test_slurm_task_becomes_a_rank(monkeypatch):
    import os

    from shardforge.launch import already_a_rank

    slurm = {
        "SLURM_NTASKS": "4",
        "SLURM_PROCID": "3",
        "SLURM_LOCALID": "1",
        "SLURM_LAUNCH_NODE_IPADDR": "10.0.0.7",
    }
    monkeypatch.setattr(os, "environ", dict(slurm))  # a private environment: nothing leaks into other tests
    assert already_a_rank()
    assert (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"]) == ("3", "4", "1")
    assert os.environ["MASTER_ADDR"] == "10.0.0.7" and os.environ["MASTER_PORT"] == "29500"


@pytest.mark.parametrize(
    ("preset", "overrides", "world", "message"),
    [
        ("tiny-llama", ["parallel.ep=2", "parallel.zero_stage=3"], 2,
         r"no experts to split.*keep parallel\.ep=1"),
        ("tiny-mixtral", ["parallel.ep=3", "parallel.zero_stage=3"], 3, r"ep=3 does not divide the model's 8 "
         r"experts \(valid here: 1\)"),
        ("tiny-mixtral", ["parallel.ep=4", "parallel.zero_stage=3"], 2,
         r"ep=4 must divide dp_shard \(2\) x cp"),
        ("tiny-llama", ["parallel.cp=2", "method.stage=dpo"], 2, r"cp=2 with method\.stage=dpo"),
        ("tiny-llama", ["parallel.cp=2", "data.max_length=126"], 2, r"max_length must be a multiple of 4 "
         r"\(it is 126; e\.g\. 124\)"),
        ("tiny-llama", ["parallel.cp=2", "parallel.tp=2", "parallel.zero_stage=3", "data.max_length=100"], 4,
         r"multiple of 8"),
        ("tiny-llama", ["parallel.cp=4", "parallel.cp_mode=ulysses"], 4, r"cp_mode: ulysses.*kv"),
        ("tiny-llama", ["parallel.cp=2", "method.stage=grpo"], 2, r"cp=2 with method\.stage=grpo"),
        ("tiny-llama", ["parallel.tp=2", "parallel.dp_shard=1", "method.stage=grpo"], 2,
         r"set parallel\.sequence_parallel: false"),
    ],
)  # fmt: skip
def test_expert_and_context_parallel_preflight(tmp_path, preset, overrides, world, message):
    """Checked with the model's shape before any process starts: what does not fit names the key, the value
    and what would."""
    from shardforge.models.build import model_source
    from shardforge.planner.layout import check_layout

    base = tiny_config(tmp_path, tmp_path / "x.jsonl", model={"preset": preset})
    cfg = load_config(None, overrides, base=base)
    with pytest.raises(ConfigError, match=message):
        check_layout(cfg, world, model_source(cfg.model)[0])


@pytest.mark.parametrize(
    ("example", "overrides", "world"),
    [
        ("moe_qwen3.yaml", [], 1),
        ("moe_qwen3.yaml", ["parallel.ep=2", "parallel.tp=2"], 4),
        ("long_context_cp.yaml", [], 2),
        ("long_context_cp.yaml", ["parallel.cp_mode=ulysses"], 2),
    ],
)
def test_the_moe_and_long_context_examples_pass_their_checks(example, overrides, world):
    """The example configs as their comments launch them (the runs themselves: the dist tests' layouts)."""
    from pathlib import Path

    from shardforge.models.build import model_source
    from shardforge.planner.layout import check_layout

    repo = Path(__file__).resolve().parents[2]
    cfg = load_config(repo / "examples" / example, overrides)
    cfg = cfg.model_copy(
        update={"model": cfg.model.model_copy(update={"tokenizer": str(repo / cfg.model.tokenizer)})}
    )
    dims, _, _ = check_layout(cfg, world, model_source(cfg.model)[0])
    assert dims.world_size == world
