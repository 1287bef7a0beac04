"""A layout at scale built for real on torch's fake process group (planner/dry_run.py): every rank's local
parameter shapes are what TP, EP and FSDP2 make of the whole shapes (computed here from the whole model by
the splitting rules alone), every parameter sits on exactly one pipeline stage, and the mesh is as asked."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from shardforge.config.schema import Config
from shardforge.models.spec import spec_for
from shardforge.planner.dry_run import DryRun, RankBuild, dry_run, model_shape

LLAMA = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 8,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,  # tp=8 splits key/value heads: at least 8 of them
    "vocab_size": 1024,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
}
MIXTRAL = {
    "model_type": "mixtral",
    "architectures": ["MixtralForCausalLM"],
    "hidden_size": 256,
    "intermediate_size": 128,  # each expert's width
    "num_hidden_layers": 4,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "vocab_size": 1002,  # not a multiple of tp=4: the vocabulary is padded to 1004
    "num_local_experts": 16,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 512,
}
COLWISE = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # split by output rows
ROWWISE = ("o_proj", "down_proj")  # split by input columns
VOCAB = ("embed_tokens.weight", "lm_head.weight")


def _config(tmp_path: Path, hf: dict, method: dict | None = None, **parallel) -> Config:
    """A run config on an HF folder with config.json alone (a dry run reads no weights)."""
    folder = tmp_path / hf["model_type"]
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(hf))
    return Config(
        model={"path": str(folder)},
        data={"train": [{"path": str(tmp_path / "unused.jsonl"), "format": "alpaca"}], "max_length": 128},
        method=method or {},
        parallel=parallel,
    )


def _whole(cfg: Config) -> dict[str, tuple[int, ...]]:
    """The unsharded model's parameter shapes."""
    shape = model_shape(cfg)
    with torch.device("meta"):
        model = spec_for(shape.family).build(shape)
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def _chunk(n: int, parts: int, index: int) -> int:
    """FSDP2's share of `n` rows for shard `index`: torch.chunk's sizes, empty past the end."""
    size = math.ceil(n / parts)
    return max(0, min(size, n - index * size))


def _tp_split(name: str, shape: tuple[int, ...], tp: int) -> list[int]:
    """A whole shape as tensor parallel leaves it on one tp rank (LoRA's A and B split as their base)."""
    out, parts = list(shape), name.split(".")
    module, leaf = (parts[-2], parts[-1]) if len(parts) > 1 else ("", parts[-1])
    if name in VOCAB:
        out[0] = math.ceil(shape[0] / tp)  # the padded vocabulary, split by rows
    elif module in COLWISE and leaf in ("weight", "lora_B"):
        out[0] //= tp
    elif module in ROWWISE and leaf in ("weight", "lora_A"):
        out[1] //= tp
    return out


def _expected(name: str, shape: tuple[int, ...], build: RankBuild, tp: int, dp: int, ep: int) -> tuple:
    """TP first, then the expert split over ep and FSDP2's dim-0 chunks (experts over edp, the rest over
    dp_shard)."""
    out = _tp_split(name, shape, tp)
    if ".experts." in name:
        out[0] //= ep
        out[0] = _chunk(out[0], dp // ep, build.coords["edp"])
    else:
        out[0] = _chunk(out[0], dp, build.coords["dp_shard"])
    return tuple(out)


def _check(run: DryRun, whole: dict[str, tuple[int, ...]], mesh: dict[str, int], ep: int = 1) -> None:
    """Shapes, stages and the mesh of every rank of `run` against what the layout should give."""
    assert run.mesh_shape == mesh
    assert [b.rank for b in run.ranks] == list(range(run.world)) and math.prod(mesh.values()) == run.world
    tp, dp, pp = mesh.get("tp", 1), mesh.get("dp_shard", 1), mesh.get("pp", 1)
    held: dict[int, set[str]] = {}
    for build in run.ranks:
        # Mesh coordinates are the rank's row-major index (pp outermost, tp innermost).
        flat = 0
        for name, size in mesh.items():
            flat = flat * size + build.coords[name]
        assert flat == build.rank
        if ep > 1:  # ep is the innermost part of dp_shard
            assert (build.coords["edp"], build.coords["ep"]) == divmod(build.coords["dp_shard"], ep)
        stage = build.coords.get("pp", 0)
        assert build.stages == ((stage,) if pp > 1 else ())
        names = set(build.params)
        assert held.setdefault(stage, names) == names, f"rank {build.rank} holds other parameters"
        for name, (local, dtype) in build.params.items():
            assert dtype == "float32"
            assert local == _expected(name, whole[name], build, tp, dp, ep), (build.rank, build.coords, name)
        assert build.param_bytes == sum(4 * math.prod(s) for s, _ in build.params.values())
    # Every parameter of the model on exactly one pipeline stage.
    assert sorted(n for names in held.values() for n in names) == sorted(whole)


def _layers(names) -> set[int]:
    return {int(n.split(".")[1]) for n in names if n.startswith("layers.")}


@pytest.mark.parametrize("world", [64, 256])
def test_dense_layout_on_every_rank(tmp_path, world):
    """pp=2 x dp_shard x tp=8, ZeRO-3 with sequence parallel and selective activation checkpointing."""
    cfg = _config(
        tmp_path, LLAMA, pp=2, tp=8, zero_stage=3, sequence_parallel=True, activation_checkpoint="selective"
    )
    run = dry_run(cfg, world)
    whole = _whole(cfg)
    _check(run, whole, {"pp": 2, "dp_shard": world // 16, "tp": 8})
    first, last = run.ranks[0].params, run.ranks[-1].params
    assert _layers(first) == {0, 1, 2, 3} and _layers(last) == {4, 5, 6, 7}
    assert "embed_tokens.weight" in first and "lm_head.weight" in last
    print(f"\ndry run of {world} ranks (pp=2 x dp_shard={world // 16} x tp=8): {run.seconds:.1f} s")


def test_experts_split_over_ep(tmp_path):
    """A Mixtral-like model on 128 ranks: pp=2 x dp_shard=16 x tp=4 with ep=4 over dp_shard (ZeRO-3)."""
    cfg = _config(tmp_path, MIXTRAL, pp=2, dp_shard=16, tp=4, ep=4, zero_stage=3)
    run = dry_run(cfg, 128)
    whole = _whole(cfg)
    assert whole["layers.0.mlp.experts.gate_up_proj"] == (16, 256, 256)
    assert whole["layers.0.mlp.experts.down_proj"] == (16, 256, 128)
    _check(run, whole, {"pp": 2, "dp_shard": 16, "tp": 4}, ep=4)
    # 4 experts per ep rank, one per edp shard; the router is whole on every tp rank, chunked by FSDP2.
    assert run.ranks[0].params["layers.0.mlp.experts.gate_up_proj"][0] == (1, 256, 256)
    assert run.ranks[0].params["layers.0.mlp.gate.weight"][0] == (1, 256)
    assert run.ranks[0].params["embed_tokens.weight"][0] == (16, 256)  # 251 rows per tp rank over 16
    print(f"\ndry run of 128 ranks (Mixtral-like, ep=4): {run.seconds:.1f} s")


def test_lora_adapters_split_as_their_base(tmp_path):
    """LoRA on dp_shard=4 x tp=2 (8 ranks, some of them only): only the adapters train, each split as its
    linear is."""
    lora = {"finetuning": "lora", "lora": {"rank": 8}}
    cfg = _config(tmp_path, LLAMA, lora, tp=2, zero_stage=3)
    run = dry_run(cfg, 8, ranks=[0, 5])
    whole = _whole(cfg)
    for name, shape in list(whole.items()):  # the adapters' whole shapes, from their base's
        module = name.rsplit(".", 2)[-2]
        if name.startswith("layers.") and module in COLWISE + ROWWISE:
            out, inp = shape
            base = name.removesuffix(".weight")
            whole[f"{base}.lora_A"], whole[f"{base}.lora_B"] = (8, inp), (out, 8)
    assert run.mesh_shape == {"dp_shard": 4, "tp": 2}
    for build in run.ranks:
        assert set(build.params) == set(whole)
        assert build.trained == {n for n in whole if n.endswith((".lora_A", ".lora_B"))}
        for name, (local, _) in build.params.items():
            assert local == _expected(name, whole[name], build, 2, 4, 1), (build.rank, name)
    assert run.ranks[1].coords == {"dp_shard": 2, "tp": 1}


def test_ddp_layout_and_process_group_left_clean(tmp_path):
    """DDP (zero_stage 0) keeps whole parameters on every rank; no process group stays behind."""
    cfg = _config(tmp_path, LLAMA, zero_stage=0)
    run = dry_run(cfg, 16, ranks=[3])
    assert run.mesh_shape == {"dp_replicate": 16} and run.ranks[0].coords == {"dp_replicate": 3}
    assert {n: s for n, (s, _) in run.ranks[0].params.items()} == _whole(cfg)
    assert not dist.is_initialized()
