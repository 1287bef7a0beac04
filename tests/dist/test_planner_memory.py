"""The planner's model-state count equals what every rank measures after its first step (memory_report:
parameters, gradients, optimizer states), byte for byte, on the layouts the engine builds: DDP, ZeRO-1's
greedy partition, FSDP2's uneven dim-0 chunks (ZeRO-2/3, HSDP), TP with a padded vocabulary, pipeline
stages, context parallel, expert parallel, LoRA and optimizer offload. Two launches (2 and 4 ranks)."""

from __future__ import annotations

import pytest

from shardforge.config import load_config
from shardforge.models.build import model_source
from shardforge.models.spec import spec_for
from shardforge.planner.layout import check_layout, layout_of
from shardforge.planner.memory import MemoryModel
from shardforge.planner.model_states import coords_of
from tests.conftest import alpaca_records, tiny_config, write_jsonl
from tests.dist._harness import run_ranks
from tests.dist._training import train_runs

TWO = {
    "ddp": {"parallel": {}},
    "zero1": {"parallel": {"zero_stage": 1}},
    "zero2": {"parallel": {"zero_stage": 2}},
    "zero3-bf16-master": {"parallel": {"zero_stage": 3}, "train": {"precision": "bf16"}},
    "zero2-offload": {"parallel": {"zero_stage": 2, "offload": "optimizer"}},
    "tp2": {"parallel": {"tp": 2}},
    "pp2": {"parallel": {"pp": 2}},
    "cp2": {"parallel": {"cp": 2, "zero_stage": 3}},
    "zero3-lora": {"parallel": {"zero_stage": 3}, "method": {"finetuning": "lora"}},
    "ep2-moe": {"parallel": {"zero_stage": 3, "ep": 2}, "model": {"preset": "tiny-qwen3-moe"}},
}
FOUR = {
    "tp2-zero3": {"parallel": {"tp": 2, "zero_stage": 3}},
    "hsdp2x2": {"parallel": {"dp_replicate": 2, "dp_shard": 2, "zero_stage": 3}},
    "pp2-tp2": {"parallel": {"pp": 2, "tp": 2}},
    "zero1-4": {"parallel": {"zero_stage": 1}},
}


def _configs(tmp_path, layouts: dict) -> list[dict]:
    data = write_jsonl(tmp_path / "train.jsonl", alpaca_records(40, seed=3))
    out = []
    for name, change in layouts.items():
        cfg = tiny_config(tmp_path / name, data, checkpoint={"save_final": False})
        cfg["train"].update(steps=1, micro_batch=4, **change.get("train", {}))
        cfg["parallel"] = change["parallel"]
        cfg["model"].update(change.get("model", {}))
        cfg["method"] = change.get("method", {})
        out.append(cfg)
    return out


def _counted(cfg_dict: dict, world: int) -> list[dict]:
    """The planner's count for every rank of this layout."""
    cfg = load_config(None, base=cfg_dict)
    shape = model_source(cfg.model)[0]
    _, _, plan = check_layout(cfg, world, shape)
    layout = layout_of(cfg, world)
    counter = MemoryModel(cfg, shape, spec_for(shape.family).costs(shape)).counter
    stages = plan.layers if plan is not None else None
    out = []
    for rank in range(world):
        c = counter.count(layout, coords_of(layout, rank), stages)
        out.append({"param_bytes": c.params, "grad_bytes": c.grads, "optim_bytes": c.optimizer})
    return out


@pytest.mark.parametrize("world,layouts", [(2, TWO), (4, FOUR)], ids=["2 ranks", "4 ranks"])
def test_model_state_count_equals_every_ranks_measurement(tmp_path, world, layouts):
    configs = _configs(tmp_path, layouts)
    per_rank = run_ranks(train_runs, world, configs, timeout=900)
    for i, (name, cfg) in enumerate(zip(layouts, configs, strict=True)):
        expected = _counted(cfg, world)
        for rank in range(world):
            measured = per_rank[rank][i]["memory"]
            got = {k: measured.get(k, 0) for k in ("param_bytes", "grad_bytes", "optim_bytes")}
            assert got == expected[rank], (name, rank, got, expected[rank])


def _auto_on_ranks(configs: list[dict]) -> list:
    """Each config's resolved parallel section on this rank, or its error (ranks started without the
    shardforge launcher, as torchrun starts them)."""
    from shardforge.errors import ConfigError
    from shardforge.train.trainer import Trainer

    out = []
    for cfg in configs:
        trainer = Trainer(load_config(None, base=cfg))
        try:
            result = trainer.train()
        except ConfigError as exc:
            out.append(str(exc))
            continue
        out.append((trainer.run.config.parallel.model_dump(), result.steps))
    return out


def test_parallel_auto_under_torchrun_takes_rank_0s_choice(tmp_path):
    data = write_jsonl(tmp_path / "train.jsonl", alpaca_records(40, seed=3))
    runs = [tiny_config(tmp_path / name, data, checkpoint={"save_final": False}) for name in ("small", "ok")]
    for cfg in runs:
        cfg.update(parallel="auto")
        cfg["train"].update(steps=1, micro_batch=2, global_batch=4)
    runs[0]["hardware"]["memory_gib"] = 1e-4  # nothing fits in 100 KiB: rank 0's error on every rank
    per_rank = run_ranks(_auto_on_ranks, 2, runs, timeout=600)
    for rank in (0, 1):
        assert "no layout of 1 node(s) x 2 cpu" in per_rank[rank][0], per_rank[rank][0]
    assert per_rank[0][1] == per_rank[1][1]  # one layout, the same on both ranks
    parallel, steps = per_rank[0][1]
    assert not parallel["auto"] and steps == 1
