"""The pipeline plan: cost-balanced and explicit layer splits, stage-to-rank maps of looped and V-shaped
schedules, the theoretical bubble, and every bad combination refused with a message naming the key."""

from __future__ import annotations

import pytest

from shardforge.config import load_config
from shardforge.config.parallel_schema import ParallelSection
from shardforge.errors import ConfigError
from shardforge.models.presets import preset_config
from shardforge.models.spec import PipelineCosts
from shardforge.parallel.dims import ParallelDims
from shardforge.parallel.pipeline_plan import balance_layers, plan_pipeline
from tests.conftest import tiny_config

DEMO = preset_config("demo", vocab_size=1024)  # 4 layers


def _plan(micro_batch: int = 4, model=DEMO, **parallel):
    return plan_pipeline(model, ParallelSection(**parallel), micro_batch, seq_len=512)


def test_balanced_split_puts_the_head_cost_on_the_last_stage():
    assert balance_layers(PipelineCosts(0.0, [1.0] * 4, 0.0), 2) == [2, 2]
    assert balance_layers(PipelineCosts(0.0, [1.0] * 5, 0.0), 2) in ([3, 2], [2, 3])
    # A head as costly as two layers: the last stage takes fewer layers.
    assert balance_layers(PipelineCosts(0.0, [1.0] * 6, 2.0), 2) == [4, 2]
    assert balance_layers(PipelineCosts(2.0, [1.0] * 6, 0.0), 2) == [2, 4]  # the embedding's cost too
    with pytest.raises(ConfigError, match="fewer than the 4 pipeline stages"):
        balance_layers(PipelineCosts(0.0, [1.0] * 3, 0.0), 4)


def test_plan_of_the_demo_model():
    plan = _plan(pp=2)
    assert plan.layers == ((0, 1), (2, 3))
    assert plan.microbatches == 2 and plan.stages_of(0) == [0] and plan.stages_of(1) == [1]
    assert plan.bubble_fraction == pytest.approx(0.5)  # (p-1)/m
    text = plan.describe()
    assert "stage 0 (rank 0): embedding + layers 0-1" in text and "layers 2-3 + norm + head + loss" in text


def test_five_layers_split_unevenly_and_say_so():
    five = preset_config("demo", vocab_size=1024)
    five.num_layers = 5
    plan = _plan(model=five, pp=2)
    assert sorted(len(layers) for layers in plan.layers) == [2, 3]
    assert "layers 0-" in plan.describe()


def test_explicit_layers_and_virtual_stages():
    plan = _plan(pp=2, pp_virtual=2, pp_schedule="interleaved_1f1b", pp_layers="1,1,1,1")
    assert plan.layers == ((0,), (1,), (2,), (3,))
    assert plan.stages_of(0) == [0, 2] and plan.stages_of(1) == [1, 3]  # looped
    assert plan.bubble_fraction == pytest.approx(1 / (2 * 4))  # (p-1)/(v*m), m = 4 stages by default
    v = _plan(pp=2, pp_virtual=2, pp_schedule="zbv", pp_layers="1,1,1,1")
    assert v.stages_of(0) == [0, 3] and v.stages_of(1) == [1, 2]  # V-shaped
    assert v.rank_of(3) == 0
    assert v.bubble_fraction == pytest.approx(1 / (2 * 4) / 3)


@pytest.mark.parametrize(
    ("parallel", "micro_batch", "message"),
    [
        (dict(pp=2, pp_microbatches=3), 4, "parallel.pp_microbatches=3 must divide train.micro_batch=4"),
        (dict(pp=4, pp_microbatches=2), 4, r"1f1b needs at least as many micro-batches as stages: "),
        (dict(pp=2, pp_virtual=2, pp_schedule="dualpipev", pp_microbatches=2), 4, "dualpipev needs at least"),
        (
            dict(pp=4, pp_virtual=2, pp_schedule="interleaved_1f1b", pp_microbatches=9),
            9,
            "multiple of its 2 rounds",
        ),
        (dict(pp=2, pp_layers="1,2"), 4, "places 3 layers; the model has 4"),
        (dict(pp=2, pp_layers="4,0"), 4, "every stage needs at least one decoder layer"),
        (dict(pp=2, pp_layers="2,2,0"), 4, "lists 3 stage"),
        (dict(pp=2, pp_layers="two,two"), 4, "expected comma-separated layer counts"),
        (
            dict(pp=4, pp_virtual=2, pp_schedule="interleaved_1f1b"),
            8,
            "the model has 4 decoder layers, fewer than the 8",
        ),
    ],
)
def test_bad_plans_are_clear_errors(parallel, micro_batch, message):
    with pytest.raises(ConfigError, match=message):
        _plan(micro_batch, **parallel)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["parallel.pp=2", "parallel.pp_schedule=1f1b", "parallel.pp_virtual=2"], "runs one stage per rank"),
        (["parallel.pp=2", "parallel.pp_schedule=interleaved_1f1b"], "set parallel.pp_virtual >= 2"),
        (["parallel.pp=2", "parallel.pp_schedule=zero_bubble"], "set parallel.pp_virtual >= 2"),
        (
            ["parallel.pp=2", "parallel.pp_schedule=zbv", "parallel.pp_virtual=3"],
            "exactly two stages per rank",
        ),
        (["parallel.pp_virtual=2"], "parallel.pp_virtual is set but parallel.pp=1"),
        (["parallel.pp_layers=2,2"], "parallel.pp_layers is set but parallel.pp=1"),
        (["parallel.pp_schedule=gpipe"], "parallel.pp_schedule is set but parallel.pp=1"),
        (
            ["parallel.pp=2", "parallel.pp_schedule=zbv", "parallel.pp_virtual=2", "parallel.zero_stage=3"],
            "with parallel.zero_stage=3 use pp_schedule 1f1b",
        ),
        (["parallel.pp_schedule=looped"], "parallel.pp_schedule"),
    ],
)
def test_bad_pipeline_config_is_refused_with_the_key(tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides, base=tiny_config(tmp_path, tmp_path / "x.jsonl"))


def test_pipeline_with_replicas_needs_fsdp():
    with pytest.raises(ConfigError, match=r"parallel.pp=2 with 2 data-parallel replicas x cp=1 needs FSDP2"):
        ParallelDims.from_config(ParallelSection(pp=2), 4)
    dims = ParallelDims.from_config(ParallelSection(pp=2, tp=2, zero_stage=2), 8)
    assert dims.describe().startswith("pp=2 x dp_shard=2 x tp=2")
