"""Pipeline parallel on gloo ranks: every schedule, uneven splits, tied embeddings across stages, activation
checkpointing, PP x TP, PP x FSDP2 and PP x FSDP2 x TP reproduce the single-process run (loss and gradient
norm per step, eval loss, final weights) over several optimizer steps with accumulation."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from tests.conftest import alpaca_records, tiny_config, write_jsonl
from tests.dist._harness import run_ranks
from tests.dist._training import (
    assert_same,
    assert_tracks,
    logged_losses,
    parity_train,
    tiny_model_folder,
    train_runs,
)

STEPS = 3
VOCAB = 1027  # odd: TP pads it, and the padding must stay invisible across stages too


def _folder(folder, layers: int, **shape) -> dict:
    return tiny_model_folder(folder, VOCAB, seed=7, num_layers=layers, num_kv_heads=2, **shape)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    folder = tmp_path_factory.mktemp("pp_data")
    return (
        write_jsonl(folder / "train.jsonl", alpaca_records(120, seed=21)),
        write_jsonl(
            folder / "eval.jsonl", alpaca_records(10, seed=22)
        ),  # 10 rows: the last eval batch is short
    )


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, dict]:
    tmp = tmp_path_factory.mktemp("pp_models")
    return {
        "llama4": _folder(tmp / "llama4", 4),
        "llama5": _folder(tmp / "llama5", 5),  # does not divide over 2 stages
        "tied4": _folder(tmp / "tied4", 4, family="qwen2", qkv_bias=True, tie_embeddings=True),
    }


def _cfg(tmp_path, name: str, data, model: dict, *, mb: int = 4, **parallel) -> dict:
    cfg = tiny_config(
        tmp_path / name,
        data[0],
        train=parity_train(STEPS, mb),
        parallel=parallel,
        checkpoint={"save_final": False},
    )
    cfg["data"]["eval"] = [{"path": str(data[1]), "format": "alpaca"}]
    cfg["model"].update(model)
    return cfg


@pytest.fixture(scope="module")
def reference(tmp_path_factory, data, models):
    tmp = tmp_path_factory.mktemp("pp_ref")
    configs = [_cfg(tmp, name, data, model) for name, model in models.items()]
    configs[-1]["checkpoint"]["every"] = 2  # tied4: its step-2 checkpoint is resumed under PP below
    for precision in ("bf16", "fp16"):  # low-precision layouts are compared with one process in the same one
        configs.append(_cfg(tmp, precision, data, models["llama4"]))
        configs[-1]["train"]["precision"] = precision
    runs = train_runs(configs)
    return dict(zip([*models, "bf16", "fp16"], runs, strict=True)) | {"tmp": tmp}


def _from_step_2(run_dir: Path, to: Path) -> Path:
    """A copy of a run folder whose newest checkpoint is the one of step 2."""
    shutil.copytree(run_dir, to)
    shutil.rmtree(to / "checkpoints" / f"step-{STEPS:08d}")
    return to


TWO_RANKS = {
    "gpipe": ("llama4", dict(pp_schedule="gpipe")),
    "1f1b": ("llama4", dict(pp_schedule="1f1b")),
    "interleaved_1f1b": ("llama4", dict(pp_schedule="interleaved_1f1b", pp_virtual=2)),
    "zero_bubble": ("llama4", dict(pp_schedule="zero_bubble", pp_virtual=2)),
    "zbv": ("llama4", dict(pp_schedule="zbv", pp_virtual=2)),
    "dualpipev": ("llama4", dict(pp_schedule="dualpipev", pp_virtual=2, pp_microbatches=4)),
    "uneven_5_layers": ("llama5", dict(pp_schedule="1f1b")),
    "pp_layers_1_4": ("llama5", dict(pp_schedule="gpipe", pp_layers="1,4")),
    "uneven_virtual": ("llama5", dict(pp_schedule="interleaved_1f1b", pp_virtual=2)),  # 5 layers, 4 stages
    "tied_1f1b": ("tied4", dict(pp_schedule="1f1b")),
    "tied_zbv": ("tied4", dict(pp_schedule="zbv", pp_virtual=2)),
    "selective_ckpt": ("llama4", dict(pp_schedule="1f1b", activation_checkpoint="selective")),
    "zero_bubble_full_ckpt": (
        "llama4",
        dict(pp_schedule="zero_bubble", pp_virtual=2, activation_checkpoint="full"),
    ),
}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, data, models, reference):
    tmp = tmp_path_factory.mktemp("pp_two")
    configs = [_cfg(tmp, name, data, models[m], pp=2, **par) for name, (m, par) in TWO_RANKS.items()]
    # Checkpoints of a tied model across layouts: PP2 saves (steps 2 and 3) ...
    configs.append(_cfg(tmp, "tied_saves", data, models["tied4"], pp=2))
    configs[-1]["checkpoint"].update(every=2, save_final=True)
    # ... and PP2 resumes the single-process run's checkpoint of step 2.
    resumed = _cfg(tmp, "tied_resumes", data, models["tied4"], pp=2)
    resumed["output_dir"] = str(_from_step_2(reference["tmp"] / "tied4" / "run", tmp / "tied_resumes_run"))
    configs.append(resumed)
    for precision in ("bf16", "fp16"):  # the stream between stages in bf16; the loss scale over stages
        configs.append(_cfg(tmp, precision, data, models["llama4"], pp=2))
        configs[-1]["train"]["precision"] = precision
    per_rank = run_ranks(train_runs, 2, configs)
    runs = dict(zip([*TWO_RANKS, "tied_saves", "tied_resumes", "bf16", "fp16"], per_rank[0], strict=True))
    return runs | {"tmp": tmp}


@pytest.mark.parametrize("name", list(TWO_RANKS))
def test_pp2_matches_single_process(two_ranks, reference, name):
    run = two_ranks[name]
    assert "pp=2" in run["layout"]
    assert_same(run, reference[TWO_RANKS[name][0]])
    # A stage holds its own layers only (built on the meta device, never the whole model).
    whole = sum(t.numel() * t.element_size() for t in reference[TWO_RANKS[name][0]]["state"].values())
    assert run["memory"]["param_bytes"] < 0.8 * whole


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_low_precision_under_pp_tracks_fp32(two_ranks, reference, precision):
    assert_tracks(two_ranks[precision], reference[precision])


def test_tied_checkpoints_cross_between_pipeline_and_single_process(two_ranks, reference, data, models):
    """The last stage's copy of a tied embedding is saved as the embedding it equals: a PP2 checkpoint
    resumes in one process, and a single-process checkpoint resumes under PP2; both continue the run."""
    tmp = two_ranks["tmp"]
    cfg = _cfg(tmp, "tied_to_single", data, models["tied4"])
    cfg["output_dir"] = str(_from_step_2(tmp / "tied_saves" / "run", tmp / "tied_to_single_run"))
    to_single = train_runs([cfg])[0]
    for run in (two_ranks["tied_saves"], two_ranks["tied_resumes"], to_single):
        assert logged_losses(Path(run["run_dir"])) == pytest.approx(reference["tied4"]["losses"], rel=1e-5)
        for key, value in reference["tied4"]["state"].items():
            torch.testing.assert_close(run["state"][key], value, rtol=1e-4, atol=1e-5)


# name: (model, parallel, micro_batch); with two data-parallel ranks, micro_batch 2 keeps the global batch 8.
FOUR_RANKS = {
    "pp2_tp2": ("llama4", dict(pp=2, tp=2), 4),
    "pp2_tp2_tied_interleaved": (
        "tied4",
        dict(pp=2, tp=2, sequence_parallel=False, pp_schedule="interleaved_1f1b", pp_virtual=2),
        4,
    ),
    "pp2_fsdp2_interleaved_tied": (
        "tied4",
        dict(pp=2, zero_stage=3, pp_schedule="interleaved_1f1b", pp_virtual=2, pp_microbatches=2),
        2,
    ),
    "pp2_tp2_zero_bubble": ("llama4", dict(pp=2, tp=2, pp_schedule="zero_bubble", pp_virtual=2), 4),
    # V-shaped: rank 1 holds the two middle stages, neither the (padded) embedding nor the head.
    "pp2_tp2_zbv": ("llama4", dict(pp=2, tp=2, pp_schedule="zbv", pp_virtual=2), 4),
    "pp2_zero2_full_ckpt_uneven": ("llama5", dict(pp=2, zero_stage=2, activation_checkpoint="full"), 2),
}


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory, data, models):
    tmp = tmp_path_factory.mktemp("pp_four")
    configs = [_cfg(tmp, name, data, models[m], mb=mb, **par) for name, (m, par, mb) in FOUR_RANKS.items()]
    configs[0]["checkpoint"]["save_final"] = True  # export of a PP x TP run, gathered from the stages
    return dict(zip(FOUR_RANKS, run_ranks(train_runs, 4, configs)[0], strict=True))


@pytest.mark.parametrize("name", list(FOUR_RANKS))
def test_pp2_with_tp_or_fsdp_matches_single_process(four_ranks, reference, name):
    run = four_ranks[name]
    assert "pp=2" in run["layout"]
    assert_same(run, reference[FOUR_RANKS[name][0]])


def test_export_of_a_pipelined_run_reloads_in_transformers(four_ranks, reference):
    from transformers import AutoModelForCausalLM

    from shardforge.models import load_model

    folder = Path(four_ranks["pp2_tp2"]["run_dir"]) / "final"
    ids = torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs = AutoModelForCausalLM.from_pretrained(folder).eval()(ids).logits
        ours = load_model(folder).eval()(ids)
        reference_model = load_model(folder)
        reference_model.load_state_dict(reference["llama4"]["state"])
        expected = reference_model.eval()(ids)
    torch.testing.assert_close(theirs, ours, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(theirs, expected, rtol=1e-4, atol=1e-4)  # the single-process run's weights


def test_pp3_middle_stage_matches_single_process(tmp_path, data, models, reference):
    """Three stages: the middle one holds neither the embedding nor the head (tied across the ends)."""
    configs = [
        _cfg(tmp_path, "tied", data, models["tied4"], pp=3, pp_microbatches=4),
        _cfg(tmp_path, "uneven", data, models["llama5"], pp=3, pp_schedule="gpipe", pp_microbatches=2),
    ]
    tied, uneven = run_ranks(train_runs, 3, configs)[0]
    assert_same(tied, reference["tied4"])
    assert_same(uneven, reference["llama5"])


def test_pp2_x_dp2_x_tp2_on_8_ranks_matches_single_process(tmp_path, data, models, reference):
    """3D: pipeline x FSDP2 (ZeRO-2) x tensor parallel on one mesh of 8 processes."""
    cfg = _cfg(tmp_path, "3d", data, models["llama4"], mb=2, pp=2, tp=2, zero_stage=2)
    run = run_ranks(train_runs, 8, [cfg], timeout=900)[0][0]
    assert "pp=2 x dp_shard=2 x tp=2" in run["layout"]
    assert_same(run, reference["llama4"])
