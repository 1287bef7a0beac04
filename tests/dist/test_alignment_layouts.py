"""Stages dpo, kto and rm on two ranks equal one process (fp32): the same losses, gradient norms, eval loss
and weights. DPO with LoRA (its reference is the adapters disabled) under ZeRO-3 and tensor parallel; full
fine-tuning with its frozen copy sharded as the policy is (ZeRO-3: half the copy on each rank; tensor
parallel); under a pipeline with the reference's log-probs precomputed (LoRA and full), while a live
reference there stops with a clear error. KTO with LoRA under ZeRO-3 (its KL estimate summed over the
data-parallel ranks; an evaluation round's filler micro-batch left out of it), tensor parallel, and a
pipeline (precomputed; one chunk per micro-batch, the KL's unit). A reward model (full) under ZeRO-3 and a
pipeline, and with LoRA under tensor parallel (its score head replicated). One launch for all."""

from __future__ import annotations

import pytest

from shardforge.config import load_config
from shardforge.errors import ConfigError
from shardforge.train.trainer import Trainer
from tests.conftest import tiny_config, write_jsonl
from tests.dist._harness import run_ranks
from tests.dist._training import assert_same, parity_train, train_runs
from tests.unit.test_dpo import _pairs
from tests.unit.test_kto import _examples


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("dpo") / "pairs.jsonl", _pairs(40, seed=3))


@pytest.fixture(scope="module")
def kto_data(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("kto") / "kto.jsonl", _examples(40, seed=3))


def _cfg(
    tmp_path,
    name,
    data,
    finetuning,
    mb,
    accum=2,
    stage="dpo",
    ref="auto",
    held=0.2,
    preset="tiny-llama",
    **parallel,
):
    return tiny_config(
        tmp_path / name,
        data,
        train={**parity_train(3, mb, accum), "eval_every": 3},
        data={"eval_fraction": held},
        parallel=parallel,
        checkpoint={"save_final": False},
        model={"preset": preset},
        method={
            "stage": stage,
            "finetuning": finetuning,
            "pref": {"beta": 0.5, "ref": ref},
            "kto": {"beta": 0.5},
        },
    )


def _pipeline_refused(cfg: dict) -> str:
    with pytest.raises(ConfigError) as info:
        Trainer(load_config(None, base=cfg)).train()
    return str(info.value)


def _two_ranks(configs: list[dict], pipeline: dict) -> tuple[list[dict], str]:
    return train_runs(configs), _pipeline_refused(pipeline)


@pytest.fixture(scope="module")
def refs(tmp_path_factory, data, kto_data):
    """The one-process runs every layout is compared with."""
    tmp_path = tmp_path_factory.mktemp("one")
    out = {f: train_runs([_cfg(tmp_path, f"one-{f}", data, f, mb=4)])[0] for f in ("lora", "full")}
    out["kto"] = train_runs([_cfg(tmp_path, "one-kto", kto_data, "lora", mb=4, stage="kto")])[0]
    # 6 held-out examples: on 2 ranks of 2 the last evaluation round has one rank run a filler micro-batch
    odd = _cfg(tmp_path, "one-kto-odd", kto_data, "lora", mb=4, stage="kto", held=0.15)
    out["kto-odd"] = train_runs([odd])[0]
    out["rm"] = train_runs([_cfg(tmp_path, "one-rm", data, "full", mb=4, stage="rm")])[0]
    out["rm-lora"] = train_runs([_cfg(tmp_path, "one-rm-lora", data, "lora", mb=4, stage="rm")])[0]
    out["moe"] = train_runs([_cfg(tmp_path, "one-moe", data, "full", mb=4, preset="tiny-qwen3-moe")])[0]
    return out


def _assert_all_same(layouts: list[tuple[str, dict]], runs: list[dict], refs: dict) -> None:
    for (finetuning, _), run in zip(layouts, runs, strict=True):
        # Full fine-tuning moves every weight, so Adam's near-sign steps on elements with ~0 gradients show
        # more last-bit noise there (worst element measured: 5.7e-5 on one machine, within 5e-5 on another).
        # The reward model's gradient norm falls 4x at step 3 (the pairs' gradients cancel), where another
        # summation order leaves a few 1e-5 of it (measured: 1.5e-5 under PP2, 2.5e-5 = 9e-6 absolute under
        # dp2 x tp2), while its losses agree within 1e-6. Full DPO under PP2 the same way: its step-1
        # gradient norm agrees to 3e-7, those after the first Adam step to 3e-5, and one weight element of
        # 4096 (a ~0 gradient) to 3.6e-4 (measured 2026-12-05, as the MoE experts below).
        full = finetuning in ("full", "rm")
        assert_same(run, refs[finetuning], rel=5e-5 if full else 1e-5, atol=5e-4 if full else 5e-5)


def test_alignment_on_two_ranks_equals_one_process(tmp_path, data, kto_data, refs):
    pp2 = {"dp_shard": 1, "pp": 2, "pp_microbatches": 2}
    pp2_whole = {"dp_shard": 1, "pp": 2, "pp_microbatches": 1, "pp_schedule": "gpipe"}
    layouts = [
        ("lora", _cfg(tmp_path, "lora-zero3", data, "lora", mb=2, zero_stage=3)),
        ("lora", _cfg(tmp_path, "lora-tp2", data, "lora", mb=4, dp_shard=1, tp=2)),
        ("full", _cfg(tmp_path, "full-zero3", data, "full", mb=2, zero_stage=3)),
        ("full", _cfg(tmp_path, "full-tp2", data, "full", mb=4, dp_shard=1, tp=2)),
        ("lora", _cfg(tmp_path, "lora-pp2", data, "lora", mb=4, ref="precompute", **pp2)),
        ("full", _cfg(tmp_path, "full-pp2", data, "full", mb=4, ref="precompute", **pp2)),
        ("kto", _cfg(tmp_path, "kto-zero3", kto_data, "lora", mb=2, stage="kto", zero_stage=3)),
        ("kto", _cfg(tmp_path, "kto-tp2", kto_data, "lora", mb=4, stage="kto", dp_shard=1, tp=2)),
        ("kto-odd", _cfg(tmp_path, "kto-odd", kto_data, "lora", mb=2, stage="kto", held=0.15, zero_stage=3)),
        (
            "kto",
            _cfg(tmp_path, "kto-pp2", kto_data, "lora", mb=4, stage="kto", ref="precompute", **pp2_whole),
        ),
        ("rm", _cfg(tmp_path, "rm-zero3", data, "full", mb=2, stage="rm", zero_stage=3)),
        ("rm", _cfg(tmp_path, "rm-pp2", data, "full", mb=4, stage="rm", dp_shard=1, pp=2, pp_microbatches=2)),
        ("rm-lora", _cfg(tmp_path, "rm-tp2", data, "lora", mb=4, stage="rm", dp_shard=1, tp=2)),
    ]
    moe = [  # an MoE policy and its frozen copy, both with their experts split over 2 ranks (EP2, ZeRO-3)
        _cfg(tmp_path, f"moe-{name}", data, "full", mb=2, preset="tiny-qwen3-moe", zero_stage=3, **extra)
        for name, extra in (("ep2", {"ep": 2}), ("zero3", {}))
    ]
    pipeline = _cfg(tmp_path, "pp", data, "lora", mb=4, dp_shard=1, pp=2, pp_microbatches=2)
    runs, refused = run_ranks(_two_ranks, 2, [cfg for _, cfg in layouts] + moe, pipeline)[0]
    runs, (moe_ep2, moe_zero3) = runs[: len(layouts)], runs[len(layouts) :]
    _assert_all_same(layouts, runs, refs)
    # EP2 equals the same split without EP in everything, the weights included; both equal one process in
    # losses and gradient norms. Their weights differ from one process' by up to 4e-4 in experts that few
    # tokens reach: Adam's near-sign steps on ~1e-9 gradients whose last bits another data split moves
    # (measured: the same 4.4e-4 with and without EP).
    assert_same(moe_ep2, moe_zero3)
    assert moe_ep2["losses"] == pytest.approx(refs["moe"]["losses"], rel=1e-5)
    assert moe_ep2["grad_norms"] == pytest.approx(refs["moe"]["grad_norms"], rel=1e-5)
    assert (
        "held during training does not run under pipeline parallel; set method.pref.ref: precompute"
        in refused
    )
    copy = refs["full"]["memory"]["param_bytes"]  # the frozen copy holds what the policy holds
    sharded = [
        run
        for (_, cfg), run in zip(layouts, runs, strict=True)
        if cfg["output_dir"].endswith("full-zero3/run")
    ]
    assert sharded[0]["reference_bytes"] == copy // 2


def test_alignment_on_four_ranks_equals_one_process(tmp_path, data, kto_data, refs):
    """Two dimensions at once: data x tensor parallel (FSDP2 on a 2-D mesh, the frozen copy sharded on
    both), data x pipeline (precomputed reference), and four-way ZeRO-3 (KTO's KL summed over 4 ranks)."""
    dp2tp2 = {"dp_shard": 2, "tp": 2, "zero_stage": 3}
    dp2pp2 = {"dp_shard": 2, "pp": 2, "pp_microbatches": 2, "zero_stage": 3}
    layouts = [
        ("full", _cfg(tmp_path, "full-dp2tp2", data, "full", mb=2, **dp2tp2)),
        ("lora", _cfg(tmp_path, "lora-dp2pp2", data, "lora", mb=2, ref="precompute", **dp2pp2)),
        ("kto", _cfg(tmp_path, "kto-zero3", kto_data, "lora", mb=1, stage="kto", zero_stage=3)),
        ("rm", _cfg(tmp_path, "rm-dp2tp2", data, "full", mb=2, stage="rm", **dp2tp2)),
    ]
    runs = run_ranks(train_runs, 4, [cfg for _, cfg in layouts])[0]
    _assert_all_same(layouts, runs, refs)
