"""Vision-language models (tiny Qwen2-VL and LLaVA, images in every record) on 2 ranks equal one process, in
one launch: DDP, ZeRO-2 and ZeRO-3 (FSDP2) for Qwen2-VL with LLaMA-Factory's default freezing (the tower and
the projector frozen) and with every part training, TP2 with and without sequence parallel (the tower whole
on both ranks, the decoder split) and PP2 (the tower on the first stage, each chunk of rows with its own
images, M-RoPE positions made before the stages); LoRA in the tower and the decoder under ZeRO-3, TP2 + SP
and PP2; DDP, ZeRO-3, TP2 + SP and PP2 for LLaVA, and ZeRO-3, TP2 + SP and PP2 for LLaVA-NeXT (its images in
tiles, its newline embedding replicated with the tower), and ZeRO-3, TP2 and PP2 for Qwen3-VL (its deepstack
features added after the first stage's layers), with every part training; and data where one record of
four has images, so that some ranks (DDP, ZeRO-3) and pipeline chunks run no image while others do; and GRPO
with image prompts (the rollout engine over the gathered ZeRO-3 units, or both tensor-parallel ranks)."""

from __future__ import annotations

import json

import pytest
import torch

from tests.dist._harness import run_ranks
from tests.dist._training import assert_same, parity_train, train_runs
from tests.vision import (
    lf_image_dataset,
    mixed_image_dataset,
    tiny_gemma3,
    tiny_llava,
    tiny_llava_next,
    tiny_qwen2_vl,
    tiny_qwen3_vl,
)

ONE = parity_train(3, mb=2)  # 4 rows a step: 2 per micro-step x 2 accumulation
RANKS = parity_train(3, mb=1)  # ... as 1 per rank x 2 accumulation x 2 ranks
LAYOUTS = {
    "ddp": {"dp_replicate": 2, "dp_shard": 1},
    "zero2": {"dp_shard": 2, "zero_stage": 2},
    "zero3": {"dp_shard": 2, "zero_stage": 3},
    "tp2": {"tp": 2, "dp_shard": 1, "sequence_parallel": False},  # the tower whole on both, the decoder split
    "tp2-sp": {"tp": 2, "dp_shard": 1, "sequence_parallel": True},
    "pp2": {"pp": 2, "dp_shard": 1, "pp_microbatches": 2},  # the tower on the first stage, a row a chunk
    "cp2": {"cp": 2, "dp_shard": 1},  # the tower on each rank's rows whole, each placing its own tokens
    # Qwen3-VL: its deepstack layers (0 and 1 of 3) on the first stage; the whole stream (no SP)
    "pp2-deepstack": {"pp": 2, "dp_shard": 1, "pp_microbatches": 2, "pp_layers": "2,1"},
}
WHOLE = {"tp2", "tp2-sp", "pp2", "pp2-deepstack", "cp2"}
PLAIN = ("ddp", "zero2", "zero3", "tp2", "tp2-sp", "pp2")  # no data parallel: each rank runs all 4 rows
METHODS = {  # method sections
    "frozen-tower": {},
    "all-parts": {"vision": {"freeze_tower": False, "freeze_projector": False}},
    "lora-tower": {"finetuning": "lora", "lora": {"rank": 4}, "vision": {"freeze_tower": False}},
    "packed": {"vision": {"freeze_tower": False, "freeze_projector": False}},  # data.packing: true
    "grpo": {  # the prompts' images sampled with by the rollout engine, every part training
        "stage": "grpo",
        "vision": {"freeze_tower": False, "freeze_projector": False},
        "rl": {
            "group_size": 4,
            "max_new_tokens": 6,
            "temperature": 1.0,
            "kl_beta": 0.1,
            "epochs_per_rollout": 2,
            "rewards": [{"name": "tests.dist.test_rl_layouts:digit_share"}],
        },
    },
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("vision")
    data = lf_image_dataset(root / "data", count=8)
    qwen2_vl = tiny_qwen2_vl(root / "qwen2_vl")
    # one record with images and three without, four rows a step: some ranks' rows have no image
    mixed = mixed_image_dataset(root / "mixed")
    records = json.loads((root / "mixed" / "mllm_demo.json").read_text())
    (root / "mixed" / "mllm_demo.json").write_text(json.dumps([records[1], *records[4:]]))
    return {
        "qwen2_vl": (qwen2_vl, data),
        "qwen2_vl/mixed": (qwen2_vl, mixed),
        "llava": (tiny_llava(root / "llava"), data),
        "llava_next": (tiny_llava_next(root / "llava_next"), data),
        "qwen3_vl": (tiny_qwen3_vl(root / "qwen3_vl"), data),
        "gemma3": (tiny_gemma3(root / "gemma3"), data),
    }


def _config(tmp_path, folders, name, train, method, parallel=None):
    model, info = folders
    return {
        "output_dir": str(tmp_path / name),
        "model": {"path": str(model)},
        "data": {"train": [{"name": "mllm_demo", "dataset_info": str(info)}], "max_length": 256,
                 "packing": name.endswith("packed"), "cache_dir": str(tmp_path / "cache")},
        "method": method,
        "train": train,
        "parallel": parallel or {},
        "log": {"tensorboard": False, "plot": False, "progress": False},
        "checkpoint": {"save_final": False},
    }  # fmt: skip


def test_vision_language_models_on_two_ranks_equal_one_process(tmp_path, folders):
    cases = [("qwen2_vl", v, layout) for v in ("frozen-tower", "all-parts") for layout in PLAIN]
    cases += [("qwen2_vl", "lora-tower", layout) for layout in ("zero3", "tp2-sp", "pp2")]
    # rows without images beside rows with: the tower gets no gradient on some ranks, in some chunks
    cases += [
        ("qwen2_vl/mixed", v, layout) for v in ("all-parts", "lora-tower") for layout in ("ddp", "zero3")
    ]
    cases += [("qwen2_vl/mixed", "lora-tower", "pp2")]
    cases += [("llava", "all-parts", layout) for layout in ("ddp", "zero3", "tp2-sp", "pp2")]
    cases += [("llava_next", "all-parts", layout) for layout in ("zero3", "tp2-sp", "pp2")]
    cases += [("qwen3_vl", "all-parts", layout) for layout in ("zero3", "tp2", "pp2-deepstack")]
    # Gemma 3 on the generic backend (transformers' model): data parallel
    cases += [("gemma3", v, layout) for v in ("frozen-tower", "all-parts") for layout in ("ddp", "zero3")]
    # context parallel: each rank places its part of the rows' image tokens (Qwen3-VL's deepstack too)
    cases += [
        (f, "all-parts", "cp2") for f in ("qwen2_vl", "qwen2_vl/mixed", "llava", "llava_next", "qwen3_vl")
    ]
    cases += [
        ("qwen2_vl", "lora-tower", "cp2"),
        ("qwen2_vl/mixed", "packed", "cp2"),
    ]  # packed: M-RoPE restarts
    # GRPO with image prompts: the rollout engine over the gathered ZeRO-3 units, or both TP ranks
    cases += [("qwen2_vl/mixed", "grpo", layout) for layout in ("zero3", "tp2")] + [
        ("llava", "grpo", "zero3")
    ]
    refs = {}
    for family, v in sorted({(f, v) for f, v, _ in cases}):
        name = f"one-{family}-{v}"
        refs[family, v] = train_runs([_config(tmp_path, folders[family], name, ONE, METHODS[v])])[0]
    configs = [
        _config(
            tmp_path,
            folders[f],
            f"{f}-{layout}-{v}",
            ONE if layout in WHOLE else RANKS,
            METHODS[v],
            LAYOUTS[layout],
        )
        for f, v, layout in cases
    ]
    runs = run_ranks(train_runs, 2, configs)[0]
    for (family, v, _), run in zip(cases, runs, strict=True):
        ref = refs[family, v]
        assert run["layout"] != ref["layout"]
        # an RL loss whose advantages cancel ends near 0, where a sum's order moves its last bits
        assert_same(run, ref, rel=1e-5, atol=1e-4, loss_atol=1e-7 if v == "grpo" else 1e-9)
    moved = refs["qwen2_vl", "all-parts"]["state"]["visual.blocks.0.attn.qkv.weight"]
    kept = refs["qwen2_vl", "frozen-tower"]["state"]["visual.blocks.0.attn.qkv.weight"]
    assert not torch.equal(moved, kept)  # the tower trained in one, not in the other
    adapted = refs["qwen2_vl", "lora-tower"]["state"]["visual.blocks.0.attn.qkv.lora_B"]
    assert adapted.abs().max() > 0  # the tower's adapters trained (B starts at 0)


def test_tensor_and_data_parallel_together_on_four_ranks(tmp_path, folders):
    """TP2 x ZeRO-3 (FSDP2 over a 2-D mesh: the tower's replicated DTensors sharded over data parallel)."""
    ref = train_runs([_config(tmp_path, folders["qwen2_vl"], "one", ONE, METHODS["all-parts"])])[0]
    parallel = {"tp": 2, "dp_shard": 2, "zero_stage": 3, "sequence_parallel": True}
    config = _config(tmp_path, folders["qwen2_vl"], "tp2-zero3", RANKS, METHODS["all-parts"], parallel)
    (run,) = run_ranks(train_runs, 4, [config])[0]
    assert_same(run, ref, rel=1e-5, atol=1e-4)
