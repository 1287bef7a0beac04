"""Data parallel and ZeRO on gloo ranks: every layout reproduces the single-process run (loss per step and
final weights), memory reports show the sharding, compression hooks behave as documented."""

from __future__ import annotations

import math

import pytest
import torch

from shardforge.config import load_config
from shardforge.train.trainer import Trainer
from tests.conftest import alpaca_records, tiny_config, write_jsonl
from tests.dist._harness import run_ranks
from tests.dist._training import assert_same, assert_tracks, parity_train, train_runs

STEPS = 5


def _cfg(
    tmp_path,
    name: str,
    data,
    *,
    mb: int,
    accum: int,
    preset: str = "tiny-llama",
    steps: int = STEPS,
    **parallel,
) -> dict:
    cfg = tiny_config(
        tmp_path / name,
        data,
        train=parity_train(steps, mb, accum),
        parallel=parallel,
        checkpoint={"save_final": False},
    )
    cfg["model"]["preset"] = preset
    return cfg


def tricks(cfg: dict) -> dict:
    """LLaMA-Factory's per-token tricks: NEFTune's noise (keyed by row, so the same under any split of packed
    rows) and the DFT loss."""
    cfg["train"]["neftune_alpha"] = 5.0
    cfg["method"] = {"sft": {"loss": "dft"}}
    return cfg


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("dp") / "train.jsonl", alpaca_records(120, seed=7))


@pytest.fixture(scope="module")
def reference(tmp_path_factory, data):
    """Single-process runs of the same global batch (8 rows), split two ways."""
    tmp = tmp_path_factory.mktemp("ref")
    configs = [
        _cfg(tmp, "mb4x2", data, mb=4, accum=2),
        _cfg(tmp, "mb2x4", data, mb=2, accum=4),
        _cfg(tmp, "tied", data, mb=4, accum=2, preset="tiny-qwen2"),
        _cfg(tmp, "short", data, mb=4, accum=2, steps=3),
        tricks(_cfg(tmp, "tricks", data, mb=4, accum=2, steps=3)),
    ]
    for precision in ("bf16", "fp16"):  # low-precision layouts are compared with one process in the same one
        configs.append(_cfg(tmp, precision, data, mb=4, accum=2))
        configs[-1]["train"]["precision"] = precision
    runs = train_runs(configs)
    return dict(zip(["mb4x2", "mb2x4", "tied", "short", "tricks", "bf16", "fp16"], runs, strict=True))


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, data):
    tmp = tmp_path_factory.mktemp("two")
    layouts = {f"zero{s}": dict(zero_stage=s) for s in range(4)}
    configs = [_cfg(tmp, name, data, mb=2, accum=2, **par) for name, par in layouts.items()]
    configs.append(_cfg(tmp, "tied", data, mb=2, accum=2, preset="tiny-qwen2", zero_stage=3))
    configs.append(_cfg(tmp, "offload_opt", data, mb=2, accum=2, zero_stage=2, offload="optimizer"))
    configs.append(_cfg(tmp, "offload_params", data, mb=2, accum=2, zero_stage=3, offload="params"))
    configs.append(_cfg(tmp, "fp16hook", data, mb=2, accum=2, steps=3, grad_compression="fp16"))
    # The demo preset spans several DDP buckets: PowerSGD's collectives must stay ordered across ranks.
    configs.append(
        _cfg(tmp, "powersgd", data, mb=2, accum=2, steps=10, preset="demo", grad_compression="powersgd")
    )
    for precision in ("bf16", "fp16"):
        configs.append(_cfg(tmp, precision, data, mb=2, accum=2, zero_stage=3))
        configs[-1]["train"]["precision"] = precision
    configs.append(tricks(_cfg(tmp, "tricks", data, mb=2, accum=2, steps=3, zero_stage=3)))
    names = [
        *layouts,
        "tied",
        "offload_opt",
        "offload_params",
        "fp16hook",
        "powersgd",
        "bf16",
        "fp16",
        "tricks",
    ]
    per_rank = run_ranks(train_runs, 2, configs)
    return {name: [rank[i] for rank in per_rank] for i, name in enumerate(names)}


def test_split_of_the_global_batch_in_one_process(reference):
    """1 process, accumulation 2 vs 4 over the same global batch: same losses and weights."""
    assert_same(reference["mb2x4"], reference["mb4x2"])


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_stages_match_single_process(two_ranks, reference, stage):
    """2 ranks x accumulation 2 x micro-batch 2 == 1 process x accumulation 2 x micro-batch 4 (and x4 x2)."""
    run = two_ranks[f"zero{stage}"][0]
    assert_same(run, reference["mb4x2"])
    assert_same(run, reference["mb2x4"])


def test_neftune_and_dft_under_zero3_match_single_process(two_ranks, reference):
    assert_same(two_ranks["tricks"][0], reference["tricks"])
    assert reference["tricks"]["losses"] != reference["short"]["losses"]


def test_tied_embeddings_under_zero3(two_ranks, reference):
    assert_same(two_ranks["tied"][0], reference["tied"])


@pytest.mark.parametrize("name", ["offload_opt", "offload_params"])
def test_offload_matches_single_process(two_ranks, reference, name):
    assert_same(two_ranks[name][0], reference["mb4x2"])


def test_fp16_compression_is_close(two_ranks, reference):
    """Losses within 1e-4 of exact after 3 steps; weights too, except the few elements whose gradient is so
    small that fp16 rounds it away: Adam normalizes every update to ~lr, so those move up to lr per step."""
    run, ref = two_ranks["fp16hook"][0], reference["short"]
    assert run["losses"] == pytest.approx(ref["losses"], rel=1e-4)
    diffs = torch.cat([(run["state"][k] - v).abs().flatten() for k, v in ref["state"].items()])
    assert diffs.max() > 0  # the hook really ran: fp16 rounding leaves a trace
    assert (diffs <= 1e-4).float().mean() > 0.999
    assert diffs.max() <= 3 * 3e-3  # 3 steps x lr


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_low_precision_under_fsdp2_tracks_fp32(two_ranks, reference, precision):
    """bf16 / fp16 parameters in forward and backward (MixedPrecisionPolicy), fp32 reduction and master
    weights: the run follows one process in the same precision."""
    assert_tracks(two_ranks[precision][0], reference[precision])


def test_powersgd_trains(two_ranks):
    run = two_ranks["powersgd"][0]
    losses = run["losses"]
    assert all(math.isfinite(x) for x in losses)
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.3
    rate, before, after = run["powersgd"]
    assert after < before and rate > 1  # gradients really went through the low-rank compression


def _sharded_bytes(state: dict[str, torch.Tensor], world: int, rank: int, per_param: int) -> int:
    """Bytes rank `rank` holds when each tensor is split on dim 0 as torch.chunk does (FSDP2's Shard(0))."""
    total = 0
    for tensor in state.values():
        chunks = torch.chunk(torch.empty(tensor.shape[0]), world)
        rows = chunks[rank].numel() if rank < len(chunks) else 0
        total += rows * (tensor.numel() // max(1, tensor.shape[0])) * per_param
    return total


def test_memory_report_shows_the_sharding(two_ranks, reference):
    state = reference["mb4x2"]["state"]  # tiny-llama, untied: every tensor is a parameter
    full = sum(t.numel() for t in state.values()) * 4
    z0 = [r["memory"] for r in two_ranks["zero0"]]
    z1 = [r["memory"] for r in two_ranks["zero1"]]
    assert all(m["param_bytes"] == full and m["grad_bytes"] == full for m in z0)
    full_optim = z0[0]["optim_bytes"]
    assert full_optim >= 2 * full  # exp_avg + exp_avg_sq (+ step counters)
    # ZeRO-1 partitions whole parameters: every state lives on exactly one rank.
    assert sum(m["optim_bytes"] for m in z1) == full_optim
    assert max(m["optim_bytes"] for m in z1) < 0.75 * full_optim
    assert all(m["param_bytes"] == full and m["grad_bytes"] == full for m in z1)
    for stage in (2, 3):
        for rank, run in enumerate(two_ranks[f"zero{stage}"]):
            mem, expected = run["memory"], _sharded_bytes(state, 2, rank, 4)
            assert mem["param_bytes"] == expected and mem["grad_bytes"] == expected
            steps = full_optim - 2 * full  # the per-parameter step counters are not sharded
            assert mem["optim_bytes"] == 2 * expected + steps


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory, data):
    tmp = tmp_path_factory.mktemp("four")
    configs = [
        _cfg(tmp, "hsdp", data, mb=1, accum=2, dp_replicate=2, dp_shard=2, zero_stage=3),
        _cfg(tmp, "zero2x4", data, mb=1, accum=2, zero_stage=2),
    ]
    per_rank = run_ranks(train_runs, 4, configs)
    return {name: [rank[i] for rank in per_rank] for i, name in enumerate(["hsdp", "zero2x4"])}


def test_hsdp_2x2_matches_single_process(four_ranks, reference):
    assert "HSDP" in four_ranks["hsdp"][0]["layout"]
    assert_same(four_ranks["hsdp"][0], reference["mb4x2"])


def test_zero2_on_four_ranks_matches_and_shards_by_four(four_ranks, reference):
    assert_same(four_ranks["zero2x4"][0], reference["mb4x2"])
    state = reference["mb4x2"]["state"]
    for rank, run in enumerate(four_ranks["zero2x4"]):
        assert run["memory"]["grad_bytes"] == _sharded_bytes(state, 4, rank, 4)
    hsdp = [r["memory"] for r in four_ranks["hsdp"]]  # HSDP shards over 2, replicates over 2
    assert hsdp[0]["param_bytes"] == _sharded_bytes(state, 2, 0, 4) == hsdp[2]["param_bytes"]


def _count_gradient_collectives(ddp_cfg: dict, fsdp_cfg: dict) -> dict[str, int]:
    """One optimizer step with accumulation 2: how many gradient reductions DDP and FSDP2 issue."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group

    counts = {"ddp_buckets": 0, "fsdp_reduces": 0}
    ddp = Trainer(load_config(None, base=ddp_cfg))
    ddp.setup()

    def counting_hook(state, bucket):
        counts["ddp_buckets"] += 1
        return default_hooks.allreduce_hook(state, bucket)

    ddp.model.register_comm_hook(None, counting_hook)
    ddp.train_step()

    original = _fsdp_param_group.foreach_reduce

    def counting_reduce(*args, **kwargs):
        counts["fsdp_reduces"] += 1
        return original(*args, **kwargs)

    _fsdp_param_group.foreach_reduce = counting_reduce
    try:
        fsdp = Trainer(load_config(None, base=fsdp_cfg))
        fsdp.setup()
        fsdp.train_step()
    finally:
        _fsdp_param_group.foreach_reduce = original
    counts["fsdp_groups"] = len(fsdp.engine.inner.layers) + 1
    return counts


def test_no_gradient_collective_on_non_final_micro_steps(tmp_path, data):
    ddp_cfg = _cfg(tmp_path, "ddp", data, mb=2, accum=2, zero_stage=0)
    fsdp_cfg = _cfg(tmp_path, "fsdp", data, mb=2, accum=2, zero_stage=3)
    counts = run_ranks(_count_gradient_collectives, 2, ddp_cfg, fsdp_cfg)[0]
    assert counts["fsdp_reduces"] == counts["fsdp_groups"]  # once per sharded group, not once per micro-step
    assert counts["ddp_buckets"] == 1  # the tiny model fits one 25 MB bucket: reduced once per step
