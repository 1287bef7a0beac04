"""Context parallel in whole training runs on gloo ranks: CP2 and CP4 (all-gather and Ulysses), alone and with
TP2 (sequence parallel), FSDP2, PP2 and expert parallel, on packed and padded rows, a sliding window and an
MoE model, each equal to one process (loss, gradient norm, eval loss, final weights; fp32, rel 1e-5); a CP2
checkpoint resumes in one process."""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path

import pytest

from shardforge.config import load_config
from shardforge.train.trainer import Trainer
from tests.conftest import alpaca_records, tiny_config, write_jsonl
from tests.dist._harness import run_ranks
from tests.dist._training import Interrupted, assert_same, parity_train, train_runs

STEPS = 3
MODELS = {"packed": "tiny-llama", "padded": "tiny-llama", "mistral": "tiny-mistral", "moe": "tiny-qwen3-moe"}


def _cfg(tmp: Path, name: str, data: tuple[Path, Path], kind: str, *, accum: int = 2, **parallel) -> dict:
    cfg = tiny_config(
        tmp / name, data[0], model={"preset": MODELS[kind]}, train=parity_train(STEPS, 4, accum),
        parallel=parallel, checkpoint={"save_final": False},
    )  # fmt: skip
    cfg["data"].update(packing=kind != "padded", eval=[{"path": str(data[1]), "format": "alpaca"}])
    return cfg


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cp")
    data = (
        write_jsonl(tmp / "train.jsonl", alpaca_records(80, seed=31)),
        write_jsonl(tmp / "eval.jsonl", alpaca_records(10, seed=32)),
    )
    return tmp, data


def _resumable(tmp: Path, data, **parallel) -> dict:
    cfg = _cfg(tmp, "saved", data, "packed", **parallel)
    cfg["train"]["steps"] = 4
    cfg["checkpoint"]["every"] = 2
    return cfg


@pytest.fixture(scope="module")
def reference(setup):
    tmp, data = setup
    configs = {kind: _cfg(tmp, f"ref_{kind}", data, kind) for kind in MODELS}
    whole = _resumable(tmp, data) | {"output_dir": str(tmp / "whole")}
    runs = train_runs([*configs.values(), whole])
    return dict(zip([*configs, "whole"], runs, strict=True))


def _two_rank_jobs(configs: list[dict], interrupted: dict) -> list[dict]:
    runs = train_runs(configs)
    original = Trainer.save_checkpoint

    def save(self, step):
        original(self, step)
        raise Interrupted

    Trainer.save_checkpoint = save
    with contextlib.suppress(Interrupted):
        Trainer(load_config(None, base=interrupted)).train()
    Trainer.save_checkpoint = original
    return runs


@pytest.fixture(scope="module")
def two_ranks(setup):
    tmp, data = setup
    layouts = {
        "cp2_packed": ("packed", dict(cp=2)),
        "cp2_padded": ("padded", dict(cp=2)),
        "cp2_window": ("mistral", dict(cp=2)),
        "cp2_moe": ("moe", dict(cp=2)),
        "cp2_ulysses": ("packed", dict(cp=2, cp_mode="ulysses")),
        "cp2_full_ckpt": ("packed", dict(cp=2, activation_checkpoint="full")),
    }
    configs = [_cfg(tmp, name, data, kind, **par) for name, (kind, par) in layouts.items()]
    saved = _resumable(tmp, data, cp=2)
    runs = run_ranks(_two_rank_jobs, 2, configs, saved, timeout=900)[0]
    resumed_dir = tmp / "resumed"
    shutil.copytree(Path(saved["output_dir"]) / "checkpoints", resumed_dir / "checkpoints")
    resumed = train_runs([_resumable(tmp, data) | {"output_dir": str(resumed_dir)}])[0]
    return {name: (layouts[name][0], runs[i]) for i, name in enumerate(layouts)} | {"resumed": ("", resumed)}


@pytest.fixture(scope="module")
def four_ranks(setup):
    tmp, data = setup
    layouts = {
        "cp4_packed": ("packed", dict(cp=4), 2),
        "cp4_padded": ("padded", dict(cp=4), 2),
        "cp2_tp2": ("packed", dict(cp=2, tp=2, zero_stage=3), 2),
        "cp2_fsdp2": ("packed", dict(cp=2, zero_stage=3), 1),
        "cp2_pp2": ("packed", dict(cp=2, pp=2, zero_stage=3), 2),
        "cp2_ep2_moe": ("moe", dict(cp=2, zero_stage=3, ep=2), 1),
    }
    configs = [
        _cfg(tmp, name, data, kind, accum=accum, **par) for name, (kind, par, accum) in layouts.items()
    ]
    runs = run_ranks(train_runs, 4, configs, timeout=900)[0]
    return {name: (layouts[name][0], runs[i]) for i, name in enumerate(layouts)}


@pytest.mark.parametrize(
    "name", ["cp2_packed", "cp2_padded", "cp2_window", "cp2_moe", "cp2_ulysses", "cp2_full_ckpt"]
)
def test_cp2_matches_one_process(two_ranks, reference, name):
    kind, run = two_ranks[name]
    assert "cp=2" in run["layout"]
    assert_same(run, reference[kind])
    if kind == "moe":  # the routing statistics are the whole rows': summed over the cp ranks
        assert run["aux_losses"] == pytest.approx(reference[kind]["aux_losses"], rel=1e-5)


@pytest.mark.parametrize(
    "name", ["cp4_packed", "cp4_padded", "cp2_tp2", "cp2_fsdp2", "cp2_pp2", "cp2_ep2_moe"]
)
def test_cp_with_other_layouts_matches_one_process(four_ranks, reference, name):
    kind, run = four_ranks[name]
    assert_same(run, reference[kind])


def test_a_cp2_checkpoint_resumes_in_one_process(two_ranks, reference):
    run, whole = two_ranks["resumed"][1], reference["whole"]
    assert run["losses"] == pytest.approx(whole["losses"][2:], rel=1e-5)
    assert_same(run | {"losses": whole["losses"], "grad_norms": whole["grad_norms"]}, whole)
