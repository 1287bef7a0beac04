"""LoRA and DoRA on every layout: 2 ranks (DDP, ZeRO-1/2/3, TP2 with sequence parallel, PP2) and 4 ranks
(FSDP2 x TP2, HSDP 2x2, PP2 x TP2) reproduce one process (loss and gradient norm per step, eval loss, final
adapter and base weights), over an HF base whose vocabulary TP must pad, and QLoRA's NF4 base sharded by FSDP2
on 2 ranks or split in 2 pipeline stages reproduces QLoRA in one process, as PiSSA's start and OFT's
rotations do (ZeRO-3, PP2); adapters on a Qwen3-MoE's fused experts (with a dense layer) train under ZeRO-3,
PP2 and full recompute as in one process; the base stays bit-identical; checkpoints hold only adapters."""

from __future__ import annotations

import shutil

import pytest
import torch

from shardforge.models.common.config import DecoderConfig
from shardforge.models.io import save_model
from shardforge.models.quantize import dequantized
from shardforge.models.spec import spec_for
from tests.conftest import TOKENIZER, alpaca_records, tiny_config, write_jsonl
from tests.dist._harness import run_ranks
from tests.dist._training import assert_same, parity_train, tiny_model_folder, train_runs

STEPS = 4
LAYOUTS_2 = {
    "ddp": {},
    "zero1": {"zero_stage": 1},
    "zero2": {"zero_stage": 2},
    "zero3": {"zero_stage": 3},
    "tp2": {"tp": 2},
    "pp2": {"pp": 2},
}


def _cfg(tmp, name: str, data, model: dict, lora: dict, mb: int = 4, **parallel) -> dict:
    cfg = tiny_config(
        tmp / name,
        data[0],
        train=parity_train(STEPS, mb, 2),
        parallel=parallel,
        method={"finetuning": "lora", "lora": {"rank": 4, "alpha": 8.0, **lora}},
        checkpoint={"save_final": False, "every": STEPS},
    )
    cfg["data"]["eval"] = [{"path": str(data[1]), "format": "alpaca"}]
    cfg["model"] = model
    return cfg


EXPERTS = {"targets": ["q_proj", "experts.gate_up_proj", "experts.down_proj"]}
PISSA = {"init": "pissa", "pissa_iter": 2}  # fast SVD: its random start is the same on every rank


def oft(cfg: dict) -> dict:
    """The same run with OFT adapters instead of LoRA's."""
    cfg["method"] = {"finetuning": "oft", "oft": {"block_size": 16}}
    return cfg


def _moe_folder(folder) -> dict:
    """A Qwen3-MoE of 4 experts (top 2) whose first layer is dense."""
    cfg = DecoderConfig(
        vocab_size=1024, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2,
        head_dim=16, qk_norm=True, family="qwen3_moe", num_experts=4, experts_per_token=2,
        moe_intermediate_size=32, norm_topk_prob=True, dense_layers=[0],
    )  # fmt: skip
    model = spec_for("qwen3_moe").build(cfg)
    model.init_weights(seed=7)
    return {"path": str(save_model(model, folder)), "preset": None, "tokenizer": str(TOKENIZER)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora")
    data = (
        write_jsonl(tmp / "train.jsonl", alpaca_records(80, seed=21)),
        write_jsonl(tmp / "eval.jsonl", alpaca_records(12, seed=22)),
    )
    model = tiny_model_folder(tmp / "base", 1027, seed=5, num_layers=2, num_kv_heads=4, family="llama")
    variants = {"lora": {}, "dora": {"dora": True}}
    refs = {v: train_runs([_cfg(tmp, f"ref_{v}", data, model, lora)])[0] for v, lora in variants.items()}
    nf4 = {**model, "quantize": "nf4"}  # QLoRA: the same comparison over the 4-bit base
    refs["qlora"] = train_runs([_cfg(tmp, "ref_qlora", data, nf4, {})])[0]
    bf16 = {**model, "dtype": "bfloat16"}  # a bf16 base under fp32 adapters
    refs["bf16base"] = train_runs([_cfg(tmp, "ref_bf16base", data, bf16, {})])[0]
    moe = _moe_folder(tmp / "moe")
    refs["experts"] = train_runs([_cfg(tmp, "ref_experts", data, moe, EXPERTS)])[0]
    refs["pissa"] = train_runs([_cfg(tmp, "ref_pissa", data, model, PISSA)])[0]
    refs["oft"] = train_runs([oft(_cfg(tmp, "ref_oft", data, model, {}))])[0]
    recompute = _cfg(tmp, "full_experts", data, moe, EXPERTS, activation_checkpoint="full")

    # global batch 8 everywhere: 4 x 2 accumulation in one process, 2 x 2 x 2 with 2 data-parallel ranks,
    # 4 x 2 x 1 where TP2 or PP2 leaves no data parallel
    def job(name: str, variant: str) -> tuple[str, dict]:
        parallel = LAYOUTS_2[name]
        mb = 4 if "pp" in parallel or "tp" in parallel else 2
        return f"{name}_{variant}", _cfg(
            tmp, f"{name}_{variant}", data, model, variants[variant], mb, **parallel
        )

    jobs = [job(name, "lora") for name in LAYOUTS_2] + [job(name, "dora") for name in ("zero3", "tp2")]
    jobs.append(("zero3_qlora", _cfg(tmp, "zero3_qlora", data, nf4, {}, 2, zero_stage=3)))
    jobs.append(("pp2_qlora", _cfg(tmp, "pp2_qlora", data, nf4, {}, 4, pp=2)))
    jobs.append(("zero3_bf16base", _cfg(tmp, "zero3_bf16base", data, bf16, {}, 2, zero_stage=3)))
    jobs.append(("zero3_experts", _cfg(tmp, "zero3_experts", data, moe, EXPERTS, 2, zero_stage=3)))
    jobs.append(("pp2_experts", _cfg(tmp, "pp2_experts", data, moe, EXPERTS, 4, pp=2)))
    jobs.append(("zero3_pissa", _cfg(tmp, "zero3_pissa", data, model, PISSA, 2, zero_stage=3)))
    jobs.append(("pp2_pissa", _cfg(tmp, "pp2_pissa", data, model, PISSA, 4, pp=2)))
    jobs.append(("zero3_oft", oft(_cfg(tmp, "zero3_oft", data, model, {}, 2, zero_stage=3))))
    jobs.append(("pp2_oft", oft(_cfg(tmp, "pp2_oft", data, model, {}, 4, pp=2))))
    two = run_ranks(train_runs, 2, [cfg for _, cfg in jobs])[0]
    four_jobs = [
        (f"fsdp_tp_{v}", _cfg(tmp, f"fsdp_tp_{v}", data, model, lora, 2, zero_stage=3, tp=2))
        for v, lora in variants.items()
    ]
    hsdp = {"dp_replicate": 2, "dp_shard": 2, "zero_stage": 3}  # 4 data-parallel ranks: 1 row a micro-batch
    four_jobs.append(("hsdp_lora", _cfg(tmp, "hsdp_lora", data, model, {}, 1, **hsdp)))
    four_jobs.append(("pp_tp_lora", _cfg(tmp, "pp_tp_lora", data, model, {}, 4, pp=2, tp=2)))
    four = run_ranks(train_runs, 4, [cfg for _, cfg in four_jobs])[0]
    # The 2-rank ZeRO-3 DoRA checkpoint (adapters only) resumed in one process: nothing is left to train, and
    # the resharded adapters are the ones saved.
    shutil.copytree(tmp / "zero3_dora", tmp / "dora_to1")
    resumed = train_runs([_cfg(tmp, "dora_to1", data, model, variants["dora"])])[0]
    out = {"refs": refs, "model": model, "tmp": tmp, "dora_to1": resumed}
    out["full_experts"], out["moe"] = train_runs([recompute])[0], moe
    out.update({name: run for (name, _), run in zip(jobs, two, strict=True)})
    out.update({name: run for (name, _), run in zip(four_jobs, four, strict=True)})
    return out


@pytest.mark.parametrize(
    "name",
    [
        *("ddp_lora", "zero1_lora", "zero2_lora", "zero3_lora", "tp2_lora", "pp2_lora"),
        *("zero3_dora", "tp2_dora", "fsdp_tp_lora", "fsdp_tp_dora", "hsdp_lora", "pp_tp_lora"),
        *("zero3_qlora", "pp2_qlora", "zero3_experts", "pp2_experts", "full_experts"),
        *("zero3_pissa", "pp2_pissa", "zero3_oft", "pp2_oft"),
    ],
)
def test_every_layout_trains_the_adapters_as_one_process(runs, name):
    run, ref = runs[name], runs["refs"][name.rsplit("_", 1)[1]]
    if name.endswith("qlora"):  # compare the 4-bit base by what it computes with
        run, ref = ({**r, "state": {k: dequantized(v) for k, v in r["state"].items()}} for r in (run, ref))
    assert_same(run, ref)


def test_only_the_adapters_change_and_checkpoints_hold_only_them(runs):
    from shardforge import load_model

    ref = runs["refs"]["dora"]
    base = load_model(runs["model"]["path"]).state_dict()
    trained = {k for k in ref["state"] if ".lora_" in k}
    assert trained and all(k.rsplit(".", 1)[0] + ".weight" in base for k in trained)
    for key, value in base.items():  # the frozen base is bit-identical after training
        assert torch.equal(ref["state"][key], value), key
    assert any(ref["state"][k].abs().max() > 0 for k in trained if "lora_B" in k)  # the adapters moved
    import torch.distributed.checkpoint as dcp

    folder = runs["tmp"] / "zero3_dora" / "run" / "checkpoints" / f"step-{STEPS:08d}"
    saved = dcp.FileSystemReader(folder).read_metadata().state_dict_metadata
    keys = [k for k in saved if k.startswith("model.")]
    assert keys and all(".lora_" in k for k in keys)  # no base weight in the checkpoint


def test_a_bf16_base_under_fp32_adapters_shards_and_tracks_one_process(runs):
    """The base computes in bf16 on both sides, summed in another order over two ranks: bf16 noise, not
    fp32 exactness (measured: equal to 1e-6 here; bound 1e-3)."""
    run, ref = runs["zero3_bf16base"], runs["refs"]["bf16base"]
    assert run["losses"] == pytest.approx(ref["losses"], rel=1e-3)
    adapters = [k for k in ref["state"] if ".lora_" in k]
    assert adapters and all(ref["state"][k].dtype == torch.float32 for k in adapters)
    assert ref["state"]["layers.0.attn.q_proj.weight"].dtype == torch.bfloat16


def test_adapter_checkpoints_resume_on_another_layout(runs):
    saved, resumed = runs["zero3_dora"]["state"], runs["dora_to1"]["state"]
    assert resumed.keys() == saved.keys()
    for key, value in saved.items():
        assert torch.equal(resumed[key], value), key


def test_the_fused_experts_adapters_train_and_the_experts_stay(runs):
    from shardforge import load_model

    ref = runs["refs"]["experts"]
    base = load_model(runs["moe"]["path"])
    moved = [k for k in ref["state"] if "experts." in k and k.endswith("_lora.lora_B")]
    assert len(moved) == 2 and all(ref["state"][k].abs().max() > 0 for k in moved)
    for key, value in base.state_dict().items():
        assert torch.equal(ref["state"][key], value), key
