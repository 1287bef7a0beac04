"""Adversarial checks of LLaMA-Factory's training menu as ported here (DFT, NEFTune, LLaMA Pro, PiSSA, OFT,
the optimizer menu and LoRA+, and `shardforge convert` of their keys), against the reference packages (peft,
transformers, LF 0.9.5's own rules) and against the rest of the framework (resume, export, serving, the
generic backend, mixtures of experts).

Tests named `test_defect_*` document a defect found here: they fail until it is fixed, and their assertion
message says what is wrong and where. The others pin behaviour that held up."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from shardforge.config import load_config
from shardforge.errors import ConfigError
from tests.conftest import alpaca_records, tiny_chat_model, tiny_config, write_jsonl

IDS = torch.tensor([[5, 17, 42, 99, 3, 8, 11, 60]])


def _random_weights(model: torch.nn.Module, std: float = 0.2) -> torch.nn.Module:
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, std)
    return model.eval()


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for file in sorted(Path(folder).glob("*.safetensors")):
        out.update(load_file(file))
    return out


# ---- LLaMA Pro: expand_blocks ------------------------------------------------------------------------------


def test_expand_blocks_keeps_a_moe_model_s_per_layer_config_in_step(tmp_path):
    """A Qwen3-MoE (Qwen2-MoE alike) whose layer 0 is dense (`mlp_only_layers: [0]`): the new block after it
    is a copy of that dense layer, but the expanded config.json still says `mlp_only_layers: [0]`, so
    transformers builds the new layer 1 as a sparse one, finds no weights for its experts and router (random,
    a warning only) and ignores the copied dense MLP: the expanded model no longer computes the original's
    logits. expand_blocks remaps `layer_types` only (shardforge/models/expand.py, the config rewrite after
    `order`): the likely fix remaps every layer-indexed list (mlp_only_layers, ...) through `order`, and
    refuses layer-index rules it cannot remap (decoder_sparse_step != 1, first_k_dense_replace, ...)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from shardforge.models.expand import expand_blocks

    cfg = Qwen3MoeConfig(vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                         num_experts=4, num_experts_per_tok=2, mlp_only_layers=[0])  # fmt: skip
    original = _random_weights(Qwen3MoeForCausalLM(cfg))
    original.save_pretrained(tmp_path / "moe")
    expand_blocks(tmp_path / "moe", tmp_path / "pro", 2)
    saved = json.loads((tmp_path / "pro" / "config.json").read_text())
    expanded = Qwen3MoeForCausalLM.from_pretrained(tmp_path / "pro", dtype=torch.float32).eval()
    with torch.no_grad():
        gap = (expanded(IDS).logits - original(IDS).logits).abs().max().item()
    assert gap < 1e-5, (
        f"the expanded Qwen3-MoE's logits differ from the original's by {gap:.3g}: its config.json keeps "
        f"mlp_only_layers={saved.get('mlp_only_layers')} for {saved['num_hidden_layers']} layers (layer 1, "
        f"the new copy of dense layer 0, is built sparse with random experts); expand.py remaps layer_types "
        f"only"
    )


def test_expand_blocks_holds_for_tied_embeddings_sharded_files_and_qwen2_layer_types(tmp_path):
    """What held up: a tied-embedding Llama read from 11 shards and written sharded, and a Qwen2 with sliding
    layers (its layer_types follow the copied blocks): each expanded model's logits equal the original's."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    from shardforge.models.expand import expand_blocks

    shape = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    tied = _random_weights(LlamaForCausalLM(LlamaConfig(**shape, tie_word_embeddings=True)))
    tied.save_pretrained(tmp_path / "tied", max_shard_size="20KB")
    assert len(list((tmp_path / "tied").glob("*.safetensors"))) > 1
    expand_blocks(tmp_path / "tied", tmp_path / "tied_pro", 2, max_shard_bytes=20_000)
    pro = LlamaForCausalLM.from_pretrained(tmp_path / "tied_pro", dtype=torch.float32).eval()
    assert pro.config.num_hidden_layers == 6
    with torch.no_grad():
        torch.testing.assert_close(pro(IDS).logits, tied(IDS).logits, rtol=0, atol=1e-6)
    sliding = dict(use_sliding_window=True, sliding_window=4, max_window_layers=2)
    qwen = _random_weights(Qwen2ForCausalLM(Qwen2Config(**shape, **sliding)))
    qwen.save_pretrained(tmp_path / "qwen2")
    expand_blocks(tmp_path / "qwen2", tmp_path / "qwen2_pro", 2)
    pro = Qwen2ForCausalLM.from_pretrained(tmp_path / "qwen2_pro", dtype=torch.float32).eval()
    kinds = qwen.config.layer_types
    assert pro.config.layer_types == [kinds[0], kinds[1], kinds[1], kinds[2], kinds[3], kinds[3]]
    ids = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(pro(ids).logits, qwen(ids).logits, rtol=0, atol=1e-6)


# ---- OFT ---------------------------------------------------------------------------------------------------


def test_oft_all_on_the_generic_backend_leaves_a_router_alone(tmp_path):
    """PhiMoE (generic backend): its router `mlp.router` is a transformers nn.Linear subclass whose forward
    returns (logits, weights, experts). LoRA's `all` skips it (apply.py `adaptable`), OFT's `all` wraps it
    (apply.py add_oft tests `isinstance(module, nn.Linear)` only), so the OFT model's forward raises
    "too many values to unpack" inside transformers. Fix: add_oft takes the linears `adaptable` takes (less
    Conv1D), as its docstring says (`all`: as LoRA's `all` takes them). Llama 4's router is the same case."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from shardforge.adapters.apply import add_lora, add_oft
    from shardforge.config.method_schema import LoraSection, OFTSection
    from shardforge.models import load_model

    torch.manual_seed(0)
    cfg = AutoConfig.for_model("phimoe", vocab_size=97, hidden_size=48, intermediate_size=80,
                               num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                               num_experts_per_tok=2)  # fmt: skip
    AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").save_pretrained(tmp_path / "phimoe")
    lora_wrapped = add_lora(load_model(tmp_path / "phimoe"), LoraSection(rank=2), seed=0)
    model = load_model(tmp_path / "phimoe")
    oft_wrapped = add_oft(model, OFTSection(block_size=4))
    extra = sorted(set(oft_wrapped) - set(lora_wrapped))
    assert not extra, (
        f"OFT's `all` wraps what LoRA's `all` leaves alone (a router with its own forward): {extra}"
    )
    model.eval()
    with torch.no_grad():
        model(torch.randint(0, 97, (1, 8)))


def test_a_peft_oft_folder_trained_with_module_dropout_merges(tmp_path):
    """LLaMA-Factory writes its `module_dropout` (OFT's multiplicative dropout, a training-time setting) into
    the OFT adapter's config. peft merges and serves such a folder as any other (the dropout does nothing out
    of training), but merge_oft refuses it ("OFT with {'module_dropout': 0.1}"), so `shardforge export
    --merge`     and serving (`shardforge.infer` with the adapter) cannot read an LF OFT run that used it.
    adapters/merge.py merge_oft: module_dropout is in the `defaults` it insists on; drop it from there."""
    from peft import OFTConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from shardforge.adapters.merge import merge_adapter
    from shardforge.models import load_model

    base = tiny_chat_model(tmp_path / "base", context=64)
    config = OFTConfig(r=0, oft_block_size=16, target_modules=["q_proj", "v_proj"], module_dropout=0.1)
    peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), config)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "oft_R" in name:
                p.normal_(0, 0.05)
    peft_model.save_pretrained(tmp_path / "oft")
    with torch.no_grad():
        theirs = peft_model.eval()(IDS).logits
    ours = load_model(base)
    try:
        merge_adapter(ours, tmp_path / "oft")
    except Exception as exc:
        pytest.fail(f"a peft OFT folder with module_dropout=0.1 (LF's module_dropout) is refused: {exc}")
    with torch.no_grad():
        out = ours(IDS)
    torch.testing.assert_close(getattr(out, "logits", out), theirs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("width", [7, 12, 40, 48, 96, 100, 130])
@pytest.mark.parametrize("block", [2, 3, 5, 16, 32, 64, 200])
def test_oft_block_size_adjustment_is_peft_s(width, block):
    """What held up: the block size a layer gets equals peft's `adjust_oft_parameters` wherever peft adjusts
    (a width the block does not divide, or a block wider than the layer), ties included."""
    from peft.tuners.oft.layer import OFTLayer

    from shardforge.adapters.oft import block_size_for

    theirs = (
        block if width % block == 0 and block <= width else OFTLayer.adjust_oft_parameters(None, width, block)
    )
    assert block_size_for(width, block) == theirs


# ---- PiSSA -------------------------------------------------------------------------------------------------


def test_pissa_with_lora_dropout_trains_as_peft_s_pissa():
    """peft's PiSSA layer computes W_res x + s B A drop(x), W_res = W - s B0 A0: the principal part it moved
    out of the base sees the undropped input. Ours computes W x + s (B A - B0 A0) drop(x) (adapters/lora.py
    LoRALinear.forward through `factors()`), which puts dropout on s B0 A0 x, W's top singular directions:
    with method.lora.dropout > 0 (LF's lora_dropout with pissa_init) every training forward differs from
    peft's by s B0 A0 (x - drop(x)), even at the first step. Eval is unaffected. Fix: in forward, take s B A
    over drop(x) and subtract s B0 A0 over x (factors() stays the rank-2r export)."""
    from peft import LoraConfig, inject_adapter_in_model

    from shardforge.adapters.lora import LoRALinear

    torch.manual_seed(0)
    base = torch.nn.Linear(24, 40, bias=False)
    ours = LoRALinear(base, 4, 8.0, 0.3, dora=False, rslora=False, pissa_iter=-1)
    ours.reset_adapter("layers.0.q_proj", seed=7)
    holder = torch.nn.Module()
    holder.q_proj = torch.nn.Linear(24, 40, bias=False)
    holder.q_proj.weight.data.copy_(base.weight)
    config = LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.3, target_modules=["q_proj"], init_lora_weights="pissa"
    )
    theirs = inject_adapter_in_model(config, holder).q_proj
    x = torch.randn(3, 24)
    ours.eval(), theirs.eval()
    torch.testing.assert_close(ours(x), theirs(x), rtol=1e-5, atol=1e-5)  # (holds: no dropout in eval)
    ours.train(), theirs.train()
    torch.manual_seed(1)  # the same dropout mask: one nn.Dropout draw per forward in each
    mine = ours(x)
    torch.manual_seed(1)
    peft_out = theirs(x)
    gap = (mine - peft_out).abs().max().item()
    assert gap < 1e-5, (
        f"PiSSA with lora dropout 0.3: our training forward differs from peft's by {gap:.3g} (outputs up to "
        f"{peft_out.abs().max().item():.3g}) on the same dropout mask: the start s B0 A0 is subtracted from "
        f"the dropped input instead of the base's"
    )


def _run_config(root: Path, base: Path, data: Path, out: str, steps: int, method: dict, train: dict,
                data_extra: dict | None = None) -> dict:  # fmt: skip
    cfg = tiny_config(root, data, method=method, checkpoint={"every": 2, "resume": "auto"},
                      train={"steps": steps, "micro_batch": 2, "grad_accum": 2, "lr": 1e-2, "warmup": 0,
                             "schedule": "constant", **train})  # fmt: skip
    cfg["output_dir"] = str(root / out)
    cfg["model"] = {"path": str(base)}
    cfg["data"].update({"packing": False, **(data_extra or {})})
    return cfg


def _resumed_equals_uninterrupted(root: Path, name: str, method: dict, train: dict, data_extra=None) -> None:
    """5 steps in one run, and 2 steps then a resumed run to 5 (checkpoint.every 2, resume auto): the final
    folders' tensors equal."""
    from shardforge.train.trainer import Trainer

    base = root / "base"
    if not base.is_dir():
        tiny_chat_model(base, context=128)
    data = write_jsonl(root / "train.jsonl", alpaca_records(16))
    run = lambda out, steps: Trainer(  # noqa: E731
        load_config(None, base=_run_config(root, base, data, out, steps, method, train, data_extra))
    ).train()
    run(f"{name}_whole", 5)
    run(f"{name}_parts", 2)
    run(f"{name}_parts", 5)
    whole, parts = _weights(root / f"{name}_whole" / "final"), _weights(root / f"{name}_parts" / "final")
    assert whole.keys() == parts.keys() and whole
    for key in whole:
        torch.testing.assert_close(parts[key], whole[key], rtol=0, atol=0, msg=f"{name}: {key}")


@pytest.mark.slow
def test_pissa_resume_export_and_serving_agree_with_peft(tmp_path):
    """What held up: a PiSSA run resumed from its step-2 checkpoint writes the adapter the uninterrupted run
    writes; `export` of its last checkpoint (adapter, and --merge) and serving (its final/ and its run folder)
    all compute what peft computes over the original base with the final adapter (rank 2r, alpha 2x)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from shardforge.checkpoint.export import export
    from shardforge.infer.load import load_for_inference

    lora = {"rank": 4, "alpha": 8.0, "init": "pissa", "pissa_iter": 2}
    _resumed_equals_uninterrupted(tmp_path, "pissa", {"finetuning": "lora", "lora": lora}, {})
    run = tmp_path / "pissa_whole"
    adapter_config = json.loads((run / "final" / "adapter_config.json").read_text())
    assert (adapter_config["r"], adapter_config["lora_alpha"]) == (8, 16.0)
    export(run, tmp_path / "exported")
    final = load_file(run / "final" / "adapter_model.safetensors")
    exported = load_file(tmp_path / "exported" / "adapter_model.safetensors")
    assert final.keys() == exported.keys()
    for key in final:
        torch.testing.assert_close(exported[key], final[key], rtol=0, atol=0)
    export(run, tmp_path / "merged", merge=True)
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32)
    with torch.no_grad():
        want = PeftModel.from_pretrained(base, run / "final").eval()(IDS).logits
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
        torch.testing.assert_close(merged(IDS).logits, want, rtol=1e-5, atol=1e-5)
        for source in (run / "final", run):
            out = load_for_inference(source, dtype="float32").model(IDS)
            torch.testing.assert_close(getattr(out, "logits", out), want, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "method", "train", "data_extra"),
    [
        ("oft", {"finetuning": "oft", "oft": {"block_size": 16}}, {}, None),
        ("neftune", {"finetuning": "full"}, {"neftune_alpha": 5.0}, None),
        ("neftune_packed", {"finetuning": "full"}, {"neftune_alpha": 5.0}, {"packing": True}),
        ("dft", {"finetuning": "full", "sft": {"loss": "dft"}}, {}, None),
        ("galore", {"finetuning": "full"},
         {"optimizer": {"name": "galore", "galore": {"rank": 4, "update_interval": 3}}}, None),
        ("muon", {"finetuning": "full"}, {"optimizer": {"name": "muon"}}, None),
        ("adam_mini", {"finetuning": "full"}, {"optimizer": {"name": "adam_mini"}}, None),
        ("adamw_8bit", {"finetuning": "full"}, {"optimizer": {"name": "adamw_8bit"}}, None),
        ("loraplus", {"finetuning": "lora", "lora": {"rank": 4, "plus_lr_ratio": 8.0}}, {}, None),
        ("llama_pro", {"finetuning": "freeze", "freeze": {"trainable_layers": 1, "llama_pro": True}}, {},
         None),
    ],
)  # fmt: skip
def test_a_resumed_run_continues_the_uninterrupted_one(tmp_path, name, method, train, data_extra):
    """What held up: with each menu item, 2 steps + a resumed run to 5 (checkpoint.every 2, resume auto) equal
    5 uninterrupted steps bit for bit (NEFTune's noise keyed by step, GaLore's projector refreshed across the
    resume, Muon's and Adam-mini's states, bitsandbytes' 8-bit states, LoRA+'s groups, OFT's rotations)."""
    _resumed_equals_uninterrupted(tmp_path, name, method, train, data_extra)


# ---- NEFTune -----------------------------------------------------------------------------------------------


def test_neftune_adds_nothing_in_eval_mode_and_is_bounded_in_training():
    """What held up: the hook leaves an eval-mode embedding alone, and in training its noise stays within
    alpha / sqrt(L d) of each row's own length, zero on the row's trailing padding."""
    from shardforge.train.neftune import NEFTune

    embed = torch.nn.Embedding(50, 16)
    noise = NEFTune(alpha=5.0, seed=3, pad_id=0)
    embed.register_forward_hook(noise.hook)
    ids = torch.tensor([[4, 9, 7, 0, 0], [3, 3, 3, 3, 3]])
    embed.eval()
    torch.testing.assert_close(embed(ids), embed.weight[ids])
    embed.train()
    added = embed(ids) - embed.weight[ids]
    assert added[0, 3:].abs().max() == 0
    assert added[0, :3].abs().max() <= 5.0 / (3 * 16) ** 0.5 and added[0, :3].abs().max() > 0
    assert added[1].abs().max() <= 5.0 / (5 * 16) ** 0.5


# ---- convert: LLaMA-Factory's rules for the menu's keys ----------------------------------------------------

LF_BASE = {"model_name_or_path": "org/model", "dataset": "alpaca_en_demo", "output_dir": "out"}


@pytest.mark.parametrize(
    ("keys", "lf_says"),
    [
        ({"finetuning_type": "oft", "use_dora": True}, "`use_dora` is only valid for LoRA training."),
        ({"finetuning_type": "oft", "use_rslora": True}, "`use_rslora` is only valid for LoRA training."),
    ],
)
def test_convert_refuses_lora_only_switches_with_oft_as_lf_does(keys, lf_says):
    """LF 0.9.5 rejects these files (hparams/finetuning_args.py __post_init__, `finetuning_type != "lora"`;
    its own parser says `lf_says`, checked through tests/lf/reference_env.py). `shardforge convert` writes
    them as an OFT run with method.lora.dora / rslora set, which OFT never reads: a file LF refuses becomes a
    run (config/lf_convert.py maps use_dora / use_rslora as plain keys; _finetuning raises for pissa and
    loraplus but not for these). Fix: raise in _finetuning (or the keys' rules) when finetuning_type is not
    lora, as LF does."""
    from shardforge.config.lf_convert import convert_lf

    try:
        converted = convert_lf({**LF_BASE, **keys})
    except ConfigError:
        return
    method = converted.config.get("method", {})
    pytest.fail(
        f"{keys}: LLaMA-Factory refuses it ({lf_says}); convert wrote finetuning "
        f"{method.get('finetuning')} with method.lora {method.get('lora')}"
    )


@pytest.mark.parametrize(
    ("keys", "match"),
    [
        ({"finetuning_type": "oft", "pissa_init": True}, r"pissa_init: only valid for LoRA"),
        ({"finetuning_type": "oft", "loraplus_lr_ratio": 4.0}, r"loraplus_lr_ratio: only valid for LoRA"),
        ({"stage": "ppo", "reward_model": "x", "pissa_init": True}, r"refuses PiSSA for stage ppo"),
        ({"stage": "kto", "pissa_init": True}, r"refuses PiSSA for stage kto"),
        ({"finetuning_type": "full", "use_llama_pro": True}, r"use_llama_pro: only valid for freeze or LoRA"),
        ({"finetuning_type": "oft", "oft_rank": 8}, r"oft_rank: 8 with oft_block_size 32"),
    ],
)
def test_convert_refuses_what_lf_refuses(keys, match):
    """What held up (each compared with LF 0.9.5's own parser while testing): these files LF rejects are
    refused by convert too."""
    from shardforge.config.lf_convert import convert_lf

    with pytest.raises(ConfigError, match=match):
        convert_lf({**LF_BASE, **keys})


def test_convert_of_pissa_with_orpo_and_fast_svd_iterations():
    """What held up: ORPO has no reference model, so LF takes PiSSA there; pissa_iter 0 is peft's
    pissa_niter_0 (fast SVD without power iterations), kept as 0, not as the default."""
    from shardforge.config.lf_convert import convert_lf

    lora = convert_lf({**LF_BASE, "stage": "dpo", "pref_loss": "orpo", "pissa_init": True}).config["method"]
    assert lora["lora"]["init"] == "pissa"
    lora = convert_lf({**LF_BASE, "pissa_init": True, "pissa_iter": 0}).config["method"]["lora"]
    assert (lora["init"], lora["pissa_iter"]) == ("pissa", 0)


def test_the_menu_is_refused_by_name_where_it_cannot_run(tmp_path):
    """What held up: layouts and combinations the menu cannot honour are config errors naming the keys."""
    data = write_jsonl(tmp_path / "d.jsonl", alpaca_records(4))
    for sections, match in [
        ({"train": {"neftune_alpha": 5.0}, "parallel": {"cp": 2}}, r"train.neftune_alpha with parallel.cp=2"),
        ({"method": {"finetuning": "lora", "lora": {"init": "pissa", "dora": True}}}, r"PiSSA starts plain"),
        ({"method": {"finetuning": "freeze", "freeze": {"trainable_layers": -2, "llama_pro": True}}},
         r"llama_pro: trainable_layers=-2"),
        ({"method": {"finetuning": "oft"}, "model": {"preset": "tiny-llama", "adapter": "x"}},
         r"model.adapter=.* set method.finetuning=lora"),
    ]:  # fmt: skip
        cfg = tiny_config(tmp_path, data, **sections)
        if "model" in sections:
            cfg["model"]["tokenizer"] = tiny_config(tmp_path, data)["model"]["tokenizer"]
        with pytest.raises(ConfigError, match=match):
            load_config(None, base=cfg)
    shutil.rmtree(tmp_path / "run", ignore_errors=True)
