"""Stages dpo and kto on two ranks equal one process (fp32): DPO with LoRA (its reference is the adapters
disabled) under ZeRO-3 and under tensor parallel, and full fine-tuning (a frozen copy as the reference) under
ZeRO-3; KTO with LoRA under ZeRO-3 (its KL estimate summed over the data-parallel ranks) and tensor
parallel: the same losses, gradient norms, eval loss and weights. A pipeline, which the reference cannot
follow yet, stops with a clear error. A reward model (full fine-tuning) under ZeRO-3 and a pipeline, and
with LoRA under tensor parallel (its score head replicated), likewise. One launch for all."""

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


def _cfg(tmp_path, name, data, finetuning, mb, accum=2, stage="dpo", **parallel):
    return tiny_config(
        tmp_path / name,
        data,
        train={**parity_train(3, mb, accum), "eval_every": 3},
        data={"eval_fraction": 0.2},
        parallel=parallel,
        checkpoint={"save_final": False},
        method={"stage": stage, "finetuning": finetuning, "pref": {"beta": 0.5}, "kto": {"beta": 0.5}},
    )


def _pipeline_refused(cfg: dict) -> str:
    with pytest.raises(ConfigError) as info:
        Trainer(load_config(None, base=cfg)).train()
    return str(info.value)


def _two_ranks(configs: list[dict], pipeline: dict) -> tuple[list[dict], str]:
    return train_runs(configs), _pipeline_refused(pipeline)


def test_dpo_and_kto_on_two_ranks_equal_one_process(tmp_path, data, kto_data):
    refs = {f: train_runs([_cfg(tmp_path, f"one-{f}", data, f, mb=4)])[0] for f in ("lora", "full")}
    refs["kto"] = train_runs([_cfg(tmp_path, "one-kto", kto_data, "lora", mb=4, stage="kto")])[0]
    refs["rm"] = train_runs([_cfg(tmp_path, "one-rm", data, "full", mb=4, stage="rm")])[0]
    refs["rm-lora"] = train_runs([_cfg(tmp_path, "one-rm-lora", data, "lora", mb=4, stage="rm")])[0]
    layouts = [
        ("lora", _cfg(tmp_path, "lora-zero3", data, "lora", mb=2, zero_stage=3)),
        ("lora", _cfg(tmp_path, "lora-tp2", data, "lora", mb=4, dp_shard=1, tp=2)),
        ("full", _cfg(tmp_path, "full-zero3", data, "full", mb=2, zero_stage=3)),
        ("kto", _cfg(tmp_path, "kto-zero3", kto_data, "lora", mb=2, stage="kto", zero_stage=3)),
        ("kto", _cfg(tmp_path, "kto-tp2", kto_data, "lora", mb=4, stage="kto", dp_shard=1, tp=2)),
        ("rm", _cfg(tmp_path, "rm-zero3", data, "full", mb=2, stage="rm", zero_stage=3)),
        ("rm", _cfg(tmp_path, "rm-pp2", data, "full", mb=4, stage="rm", dp_shard=1, pp=2, pp_microbatches=2)),
        ("rm-lora", _cfg(tmp_path, "rm-tp2", data, "lora", mb=4, stage="rm", dp_shard=1, tp=2)),
    ]
    pipeline = _cfg(tmp_path, "pp", data, "lora", mb=4, dp_shard=1, pp=2, pp_microbatches=2)
    runs, refused = run_ranks(_two_ranks, 2, [cfg for _, cfg in layouts], pipeline)[0]
    for (finetuning, _), run in zip(layouts, runs, strict=True):
        # Full fine-tuning moves every weight, so Adam's near-sign steps on elements with ~0 gradients show
        # more last-bit noise there (worst element measured: 5.7e-5 on one machine, within 5e-5 on another).
        # The reward model's gradient norm falls 4x at step 3 (the pairs' gradients cancel), where the
        # pipeline's other summation order leaves 1.5e-5 of it (measured; 5e-6 absolute).
        full = finetuning in ("full", "rm")
        assert_same(
            run, refs[finetuning], rel=2e-5 if finetuning == "rm" else 1e-5, atol=1e-4 if full else 5e-5
        )
    assert "does not run under pipeline parallel yet" in refused
