"""LoRA, DoRA and rsLoRA as PEFT defines them: the layer against the published formulas, PEFT adapter folders
that peft loads over the transformers base with every key matched and the same logits (llama, qwen2, qwen3
shapes), merged weights that compute what the adapted model does, and freeze tuning's trainable set."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch
import transformers
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM

from shardforge import load_model
from shardforge.adapters.apply import add_lora, freeze
from shardforge.adapters.lora import LoRALinear
from shardforge.adapters.peft_format import merged_state, read_adapter, save_adapter
from shardforge.config import load_config
from shardforge.config.method_schema import FreezeSection, LoraSection
from shardforge.errors import ConfigError
from shardforge.models.io import hf_state_dict
from tests.conftest import REPO

BASE = dict(vocab_size=97, hidden_size=48, intermediate_size=80, num_hidden_layers=2)
SHAPES = {
    "llama": dict(num_attention_heads=6, num_key_value_heads=3, head_dim=8),
    "qwen2": dict(num_attention_heads=6, num_key_value_heads=2, tie_word_embeddings=True),  # q/k/v biases
    "qwen3": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16),  # q/k norms
    "mistral": dict(num_attention_heads=6, num_key_value_heads=2, sliding_window=8),
    "mixtral": dict(num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2),
    # mixtures of experts with a dense layer (and Qwen2-MoE's shared expert): `all` is the attention there
    "qwen3_moe": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4,
                      num_experts_per_tok=2, moe_intermediate_size=32, mlp_only_layers=[0]),
    "qwen2_moe": dict(num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=32, shared_expert_intermediate_size=48, mlp_only_layers=[1]),
}  # fmt: skip
# 2 layers x 4 (attention: peft_names.py); others 2 x 7 (Qwen2-MoE: its shared expert and dense layer's MLP)
WRAPPED = {"qwen3_moe": 8, "mixtral": 8}
VARIANTS = {"lora": {}, "dora": {"dora": True}, "rslora": {"rslora": True, "alpha": 4.0}}


def _hf_folder(tmp_path, family: str):
    torch.manual_seed(0)
    cfg = AutoConfig.for_model(family, **BASE, **SHAPES[family])
    hf = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    folder = tmp_path / f"hf_{family}"
    hf.save_pretrained(folder)
    return folder


def _trained_adapters(model: torch.nn.Module) -> None:
    """Adapters as training leaves them: B no longer zero, magnitudes moved."""
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, LoRALinear):
                module.lora_B.copy_(torch.randn(module.lora_B.shape, generator=gen) * 0.2)
                if module.lora_magnitude is not None:
                    module.lora_magnitude.mul_(1 + 0.1 * torch.randn(module.out_features, generator=gen))


def _ids() -> torch.Tensor:
    return torch.randint(0, 97, (2, 17), generator=torch.Generator().manual_seed(1))


def test_the_layer_computes_the_published_formulas():
    torch.manual_seed(0)
    base = torch.nn.Linear(12, 10, bias=True)
    x = torch.randn(3, 5, 12)
    for dora, rslora in [(False, False), (True, False), (False, True)]:
        layer = LoRALinear(base, rank=4, alpha=8.0, dropout=0.0, dora=dora, rslora=rslora)
        layer.reset_adapter("layers.0.attn.q_proj", seed=0)
        w, b = base.weight.detach(), base.bias.detach()
        scale = 8.0 / math.sqrt(4) if rslora else 8.0 / 4
        assert layer.scale == scale
        assert torch.allclose(layer(x), x @ w.T + b)  # B = 0: a fresh adapter changes nothing
        assert layer.lora_A.abs().max() <= 1 / math.sqrt(12) and layer.lora_A.std() > 0.1  # kaiming-uniform
        with torch.no_grad():
            layer.lora_B.normal_()
            if dora:
                layer.lora_magnitude.mul_(1.5)
        a, bb = layer.lora_A.detach(), layer.lora_B.detach()
        delta = scale * bb @ a
        if not dora:
            want = x @ (w + delta).T + b
        else:  # DoRA (Liu et al. 2024, eq. 5): m (W + dW) / ||W + dW||_row, then the bias
            m = layer.lora_magnitude.detach()
            want = x @ ((m / (w + delta).norm(dim=1)).unsqueeze(1) * (w + delta)).T + b
        out = layer(x)
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(x @ layer.merged_weight().T + b, want, rtol=1e-5, atol=1e-5)
        out.square().sum().backward()
        assert base.weight.grad is None and layer.lora_A.grad is not None
        if dora:  # the norm is a constant for the gradient: d out / d m = (W + dW) x / ||W + dW||
            norm = (w + delta).norm(dim=1)
            expected = (2 * out * ((x @ (w + delta).T) / norm)).sum(dim=(0, 1))
            torch.testing.assert_close(layer.lora_magnitude.grad, expected, rtol=1e-4, atol=1e-4)
        base.weight.requires_grad_(True)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("family", sorted(SHAPES))
def test_peft_loads_our_adapter_with_every_key_and_the_same_logits(tmp_path, family, variant):
    from peft import PeftModel, get_peft_model_state_dict

    folder = _hf_folder(tmp_path, family)
    ours = load_model(folder).eval()
    section = LoraSection(rank=4, **VARIANTS[variant])
    wrapped = add_lora(ours, section, seed=0)
    assert len(wrapped) == WRAPPED.get(family, 2 * 7)  # every linear of attention and MLP in both layers
    _trained_adapters(ours)
    state = ours.state_dict()
    adapters = {k: v for k, v in state.items() if ".lora_" in k}
    out = save_adapter(tmp_path / "adapter", ours.config.family, adapters, section, str(folder))
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["task_type"] == "CAUSAL_LM" and config["r"] == 4
    assert config["use_dora"] == section.dora and config["use_rslora"] == section.rslora
    assert config["base_model_name_or_path"] == str(folder)
    base = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager")
    peft_model = PeftModel.from_pretrained(base, out).eval()
    # peft loads non-strictly: what it holds (under the names it saves) must be exactly our tensors
    held = get_peft_model_state_dict(peft_model)
    saved = load_file(str(out / "adapter_model.safetensors"))
    assert set(held) == set(saved) and len(saved) == len(adapters)
    assert all(torch.equal(held[k], saved[k]) for k in saved)
    with torch.no_grad():
        want = ours(_ids())
        got = peft_model(_ids()).logits
        assert (got - want).abs().max().item() < 1e-4
        merged = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
        plain = hf_state_dict(ours, merged_state(ours, state))
        merged.load_state_dict(plain, strict=False)  # a tied head is written once, as the embedding
        assert (merged(_ids()).logits - want).abs().max().item() < 1e-4
    _, back = read_adapter(out, ours.config.family)
    assert set(back) == set(adapters) and all(torch.equal(back[k], adapters[k]) for k in back)


def test_lora_targets_and_freeze_choose_what_trains(tmp_path):
    folder = _hf_folder(tmp_path, "llama")
    model = load_model(folder)
    add_lora(model, LoraSection(targets=["q_proj", "v_proj"]), seed=0)
    trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    assert trainable == sorted(
        f"layers.{i}.attn.{m}.lora_{ab}" for i in (0, 1) for m in ("q_proj", "v_proj") for ab in "AB"
    )
    model = load_model(folder)
    freeze(model, FreezeSection(trainable_layers=1, extra_modules=["norm"]))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    last = {n for n, _ in model.named_parameters() if n.startswith("layers.1.")}
    assert trainable == last | {"norm.weight"}
    freeze(model, FreezeSection(trainable_layers=-1))
    assert {n for n, p in model.named_parameters() if p.requires_grad} == {
        n for n, _ in model.named_parameters() if n.startswith("layers.0.")
    }


def test_bad_lora_settings_are_one_line_errors(tmp_path):
    base = {"model": {"preset": "tiny-llama", "tokenizer": "t"}, "data": {"train": [{"path": "x.jsonl"}]}}
    with pytest.raises(ConfigError, match=r"method.lora.rank.*greater than or equal to 1"):
        load_config(None, ["method.finetuning=lora", "method.lora.rank=0"], base=base)
    with pytest.raises(ConfigError, match=r"unknown module 'qkv'; valid: all, or some of q_proj, k_proj"):
        load_config(None, ["method.finetuning=lora", "method.lora.targets=[q_proj,qkv]"], base=base)


def test_training_starts_from_an_existing_adapter_and_a_mismatch_is_named(tmp_path):
    from shardforge.adapters.apply import apply_finetuning
    from shardforge.config.method_schema import MethodSection
    from shardforge.errors import ModelError

    folder = _hf_folder(tmp_path, "qwen3")
    trained = load_model(folder).eval()
    section = LoraSection(rank=4, dora=True)
    add_lora(trained, section, seed=0)
    _trained_adapters(trained)
    adapters = {k: v for k, v in trained.state_dict().items() if ".lora_" in k}
    out = save_adapter(tmp_path / "adapter", "qwen3", adapters, section, str(folder))
    resumed = load_model(folder).eval()
    apply_finetuning(resumed, MethodSection(finetuning="lora", lora=section), seed=1, adapter=str(out))
    with torch.no_grad():
        assert torch.equal(resumed(_ids()), trained(_ids()))
    other = load_model(folder)
    settings = r"r=4 in the adapter but 8 in method.lora; use_dora=True .* but False"
    with pytest.raises(ModelError, match=settings):
        apply_finetuning(other, MethodSection(finetuning="lora"), seed=0, adapter=str(out))
    targets = r"its target modules \(down_proj, .*\) differ from method.lora.targets"
    with pytest.raises(ModelError, match=targets):
        few = LoraSection(rank=4, dora=True, targets=["q_proj"])
        apply_finetuning(load_model(folder), MethodSection(finetuning="lora", lora=few), 0, str(out))
    smaller = tmp_path / "smaller"
    cfg = AutoConfig.for_model("qwen3", **{**BASE, "hidden_size": 32}, **SHAPES["qwen3"])
    AutoModelForCausalLM.from_config(cfg).save_pretrained(smaller)
    with pytest.raises(ModelError, match=r"the adapter was trained over another base"):
        apply_finetuning(load_model(smaller), MethodSection(finetuning="lora", lora=section), 0, str(out))
    base = {"model": {"preset": "tiny-llama", "tokenizer": "t", "adapter": str(out)}}
    with pytest.raises(ConfigError, match=r"model.adapter=.* set method.finetuning=lora \(it is full\)"):
        load_config(None, base={**base, "data": {"train": [{"path": "x.jsonl"}]}})


def test_freeze_training_changes_only_the_chosen_parameters(tmp_path):
    from shardforge.train.trainer import Trainer
    from tests.conftest import alpaca_records, tiny_config, write_jsonl
    from tests.dist._training import tiny_model_folder

    base = tiny_model_folder(tmp_path / "base", 1024, seed=1, num_layers=3, num_kv_heads=2, family="llama")
    data = write_jsonl(tmp_path / "train.jsonl", alpaca_records(24, seed=2))
    freeze_section = {"trainable_layers": 1, "extra_modules": ["norm"]}
    cfg = tiny_config(tmp_path, data, method={"finetuning": "freeze", "freeze": freeze_section})
    cfg["model"] = base
    trainer = Trainer(load_config(None, base=cfg))
    trainer.train()
    before, after = load_model(base["path"]).state_dict(), trainer.full_state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    chosen = {k for k in before if k.startswith("layers.2.")} | {"norm.weight"}
    assert changed == chosen  # every chosen tensor moved, every other one is bit-identical
    assert trainer.memory["frozen_param_bytes"] > trainer.memory["trained_param_bytes"] > 0


@pytest.mark.parametrize("preset", ["tiny-qwen2-moe", "tiny-llama"])
def test_native_models_choose_only_the_named_projections_for_lora_all_and_nf4(preset):
    """On our own models `targets: all` is the seven projections and NF4 holds the blocks' attn / mlp
    projections; a MoE block's other linears (qwen2-moe's shared-expert gate) stay as they are, and NF4
    leaves the shared expert. Only the generic backend widens `all` to every linear of the blocks."""
    from shardforge.config.method_schema import LINEAR_TARGETS
    from shardforge.models import build_preset
    from shardforge.models.quantize import QUANTIZED, quantized_names

    model = build_preset(preset, vocab_size=50)
    assert all(QUANTIZED.match(name) for name in quantized_names(model))  # no shared_expert.*_proj
    wrapped = add_lora(model, LoraSection(targets="all"), seed=0)
    assert wrapped and all(name.rpartition(".")[2] in LINEAR_TARGETS for name in wrapped)
    assert not any(name.endswith("shared_expert_gate") for name in wrapped)


def test_the_linear_subclasses_lora_wraps_compute_a_plain_linear_map():
    """AFFINE_LINEARS names transformers' nn.Linear subclasses LoRA wraps (its layer computes F.linear): each
    must really be that map, and a subclass whose forward is its own (a router) is not wrapped."""
    import importlib

    import torch.nn.functional as F
    from torch import nn

    from shardforge.adapters.apply import AFFINE_LINEARS, adaptable

    where = {"FalconLinear": "transformers.models.falcon.modeling_falcon"}
    assert set(where) == AFFINE_LINEARS  # a name added there needs its check here
    x = torch.randn(3, 5, 16)
    for name, module in where.items():
        cls = getattr(importlib.import_module(module), name)
        for bias in (False, True):
            layer = cls(16, 8, bias=bias)
            if bias:
                torch.nn.init.normal_(layer.bias)
            assert adaptable(layer)
            torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))

    class Router(nn.Linear):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
            return super().forward(x).topk(2)

    assert not adaptable(Router(16, 8)) and adaptable(nn.Linear(16, 8))
    assert not adaptable(LoRALinear(nn.Linear(16, 8), 2, 4.0, 0.0, False, False))


def test_the_mlp_of_a_mixture_of_experts_is_refused_by_name():
    """peft reads gate_proj, up_proj and down_proj as Qwen3-MoE's fused experts: naming them is refused
    (their adapters on dense layers would not load in peft as trained). Qwen2-MoE's peft leaves alone."""
    from shardforge.models import build_preset

    model = build_preset("tiny-qwen3-moe", vocab_size=50)
    with pytest.raises(ConfigError, match=r"targets on qwen3_moe: gate_proj: peft reads it as the fused"):
        add_lora(model, LoraSection(targets=["q_proj", "gate_proj", "up_proj"]), seed=0)


def test_the_names_left_out_for_peft_are_peft_s_own():
    """adapters/peft_names.py copies peft's tables: the MoE families whose linear names it reads as fused
    experts, and the Mamba-based ones on whose out_proj / conv1d it refuses LoRA. Each equals what the
    installed peft does, over every causal-LM model_type transformers registers."""
    from types import SimpleNamespace

    from peft import LoraConfig
    from peft.tuners.tuners_utils import _check_lora_target_modules_mamba
    from peft.utils.transformers_weight_conversion import (
        _MODEL_TO_CONVERSION_PATTERN,
        _MOE_TARGET_MODULE_MAPPING,
    )
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from shardforge.adapters.peft_names import REREAD, not_for_peft

    config = LoraConfig(target_modules=["q_proj"])
    for model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        pattern = _MODEL_TO_CONVERSION_PATTERN.get(model_type, "")  # peft's own lookup
        refused = set()
        for name in ("out_proj", "conv1d", "q_proj", "gate_proj"):
            model = SimpleNamespace(config=SimpleNamespace(model_type=model_type))
            try:
                _check_lora_target_modules_mamba(config, model, name)
            except ValueError:
                refused.add(name)
        assert set(not_for_peft(model_type)) == set(_MOE_TARGET_MODULE_MAPPING.get(pattern, {})) | refused
    # No stale names, with the tested transformers (constraints.txt); an older one (5.17) registers fewer
    # model types, and the names it lacks are for a newer one
    tested = re.search(r"^transformers==(\S+)$", (REPO / "constraints.txt").read_text(), re.M).group(1)
    if transformers.__version__ == tested:
        assert set(REREAD) <= set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


EXPERT_SHAPES = {  # native (Mixtral, Qwen3-MoE with a dense layer, Qwen2-MoE with its shared expert) and
    # generic-backend mixtures of experts (OLMoE; GPT-OSS, whose experts are stored [E, in, out])
    "mixtral": SHAPES["mixtral"],
    "qwen3_moe": SHAPES["qwen3_moe"],
    "qwen2_moe": SHAPES["qwen2_moe"],
    "olmoe": dict(num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2),
    "gpt_oss": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=12, num_local_experts=4,
                    num_experts_per_tok=2, layer_types=["full_attention"] * 2),
}  # fmt: skip
EXPERT_TARGETS = {
    "both": ["q_proj", "v_proj", "experts.gate_up_proj", "experts.down_proj"],  # peft nests two wrappers
    "down": ["experts.down_proj"],
}


@pytest.mark.parametrize("targets", sorted(EXPERT_TARGETS))
@pytest.mark.parametrize("family", sorted(EXPERT_SHAPES))
def test_peft_loads_adapters_on_the_fused_experts_exactly(tmp_path, monkeypatch, family, targets):
    """Adapters on the 3-D expert weights are peft's target_parameters: peft holds exactly our tensors under
    its nested names and computes our logits; the merged weights (an export, and an inference load of the
    adapter folder) compute them too; disabling the adapters gives the base."""
    from peft import PeftModel, get_peft_model_state_dict

    from shardforge.adapters.expert_lora import ParamLoRA
    from shardforge.adapters.lora import adapters_disabled
    from shardforge.adapters.merge import merge_adapter

    monkeypatch.setitem(SHAPES, family, EXPERT_SHAPES[family])
    folder = _hf_folder(tmp_path, family)
    ours = load_model(folder).eval()
    section = LoraSection(rank=2, targets=EXPERT_TARGETS[targets])
    add_lora(ours, section, seed=0)
    experts = [m for m in ours.modules() if isinstance(m, ParamLoRA)]
    sparse = 1 if family in ("qwen3_moe", "qwen2_moe") else 2  # layers with experts (one dense there)
    assert len(experts) == (2 if targets == "both" else 1) * sparse
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for module in ours.modules():
            if isinstance(module, (LoRALinear, ParamLoRA)):
                module.lora_B.copy_(torch.randn(module.lora_B.shape, generator=gen) * 0.2)
    state = ours.state_dict()
    adapters = {k: v for k, v in state.items() if ".lora_" in k}
    out = save_adapter(tmp_path / "adapter", ours.config.family, adapters, section, str(folder))
    config = json.loads((out / "adapter_config.json").read_text())
    wanted = sorted(f"mlp.{t}" for t in EXPERT_TARGETS[targets] if t.startswith("experts."))
    assert config["target_parameters"] == wanted
    assert config["target_modules"] == sorted(t for t in EXPERT_TARGETS[targets] if "." not in t)
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(folder), out).eval()
    held, saved = get_peft_model_state_dict(peft_model), load_file(str(out / "adapter_model.safetensors"))
    assert set(held) == set(saved) and len(saved) == len(adapters)
    assert all(torch.equal(held[k], saved[k]) for k in saved)
    with torch.no_grad():
        want = ours(_ids())
        base = load_model(folder).eval()
        assert (base(_ids()) - want).abs().max().item() > 1e-2  # the adapters change the logits
        assert (peft_model(_ids()).logits - want).abs().max().item() < 1e-4
        with adapters_disabled(ours):
            assert (ours(_ids()) - base(_ids())).abs().max().item() < 1e-6
        merged = AutoModelForCausalLM.from_pretrained(folder).eval()
        merged.load_state_dict(hf_state_dict(ours, merged_state(ours, state), "fused"), strict=False)
        assert (merged(_ids()).logits - want).abs().max().item() < 1e-4
        merge_adapter(base, out)  # what generate / serve do with an adapter folder
        assert not any(isinstance(m, ParamLoRA) for m in base.modules())
        assert (base(_ids()) - want).abs().max().item() < 1e-4
    _, back = read_adapter(out, ours.config.family)
    assert set(back) == set(adapters) and all(torch.equal(back[k], adapters[k]) for k in back)


def test_adapters_on_the_fused_experts_are_refused_where_peft_or_the_layout_cannot_follow(tmp_path):
    from shardforge.models import build_preset

    with pytest.raises(ValueError, match="the fused experts take neither dora nor dropout"):
        LoraSection(targets=["experts.down_proj"], dropout=0.1)
    with pytest.raises(ValueError, match=r"unknown module 'experts\.up_proj'.*experts\.gate_up_proj"):
        LoraSection(targets=["experts.up_proj"])
    with pytest.raises(ConfigError, match="the llama layers have no fused experts"):
        add_lora(build_preset("tiny-llama", vocab_size=50), LoraSection(targets=["experts.down_proj"]), 0)
    base = {"model": {"preset": "tiny-qwen3-moe", "tokenizer": "t"}, "data": {"train": [{"path": "x"}]}}
    method = {"finetuning": "lora", "lora": {"targets": ["q_proj", "experts.gate_up_proj"]}}
    for parallel in ({"tp": 2}, {"ep": 2, "zero_stage": 3}):
        with pytest.raises(ConfigError, match=r"experts\.gate_up_proj with parallel\.[te]p=2: adapters on"):
            load_config(None, base={**base, "method": method, "parallel": parallel})


def test_numbered_linears_are_named_whole_for_peft(tmp_path):
    """Zamba2's adapters are nn.Sequential children (`...adapter_list.0.0`): as the short name `0`, peft
    would take every module whose name ends in `.0` (`layers.0`, a whole layer) and fail; they are written
    as full names, and peft reloads the adapter with our logits."""
    import sys

    from peft import PeftModel

    sys.path.insert(0, str(REPO / "benchmarks"))
    import family_sweep

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(family_sweep.tiny_config("zamba2")).eval()
    hf.save_pretrained(tmp_path / "base")
    ours = load_model(tmp_path / "base").eval()
    section = LoraSection(rank=2)
    add_lora(ours, section, seed=0)
    _trained_adapters(ours)
    adapters = {k: v for k, v in ours.state_dict().items() if ".lora_" in k}
    out = save_adapter(tmp_path / "adapter", ours.config.family, adapters, section, str(tmp_path / "base"))
    targets = json.loads((out / "adapter_config.json").read_text())["target_modules"]
    assert "0" not in targets and any(t.endswith("adapter_list.0.0") for t in targets), targets
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    peft_model = PeftModel.from_pretrained(base, out).eval()
    ids = torch.randint(0, 1024, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (peft_model(ids).logits - ours(ids)).abs().max().item() < 1e-4


def test_a_short_name_that_ends_a_module_without_an_adapter_is_written_whole(tmp_path):
    """peft matches target_modules as suffixes: a short name that also ends a module we did not adapt
    (here a made-up `vision.q_proj`) would give that module a fresh adapter in peft, so such names are
    written whole; the others stay short."""
    from shardforge.checkpoint.export import plain_modules
    from shardforge.models import build_preset

    model = build_preset("tiny-llama", vocab_size=50)
    section = LoraSection(rank=2, targets=["q_proj", "v_proj"])
    add_lora(model, section, seed=0)
    state = model.state_dict()
    others = plain_modules(model.config.family, state)
    assert "model.layers.0.self_attn.k_proj" in others and "model.layers.0.self_attn.q_proj" not in others
    adapters = {k: v for k, v in state.items() if ".lora_" in k}
    out = save_adapter(tmp_path / "a", "llama", adapters, section, None, others=[*others, "vision.q_proj"])
    targets = json.loads((out / "adapter_config.json").read_text())["target_modules"]
    assert targets == ["model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.q_proj", "v_proj"]
