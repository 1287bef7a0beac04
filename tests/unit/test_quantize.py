"""Quantized weights for the engine: `--quantize int8|int4` (torchao's numbers, torch's weight-only kernels)
against torchao and a plain dequantized matmul; a quantized tiny model's greedy tokens against fp32; AWQ,
GPTQ (act-order too) and compressed-tensors fp8 folders built here from a tiny model in each format's
documented packing (AutoAWQ's `pack`, AutoGPTQ's `qlinear_cuda_old.pack`) and loaded; refusals by name; the
`generate` command; a QLoRA run served."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from shardforge.cli import main
from shardforge.errors import ConfigError, ModelError
from shardforge.infer.engine import Engine
from shardforge.infer.load import load_for_inference
from shardforge.infer.packed import inference_layout, restore
from shardforge.infer.prequantized import Format, awq_weight, gptq_weight
from shardforge.infer.quantized import (
    Int4Weight,
    Int8Weight,
    Quantization,
    QuantizedLinear,
    linear_reference,
    quantize_for_inference,
)
from shardforge.infer.sampling import SamplingParams
from shardforge.models.common.config import DecoderConfig
from shardforge.models.io import hf_state_dict, save_model
from shardforge.models.llama.model import Decoder
from tests.conftest import TOKENIZER

IDS = torch.randint(0, 1000, (2, 12), generator=torch.Generator().manual_seed(0))
PROMPTS = [[1, 2, 3, 4, 5], [9, 8, 7], [100, 200, 300, 400]]
GROUP = 32
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def _tiny(seed: int = 0) -> Decoder:
    cfg = DecoderConfig(vocab_size=1024, hidden_size=64, intermediate_size=128, num_heads=4, head_dim=16,
                        num_layers=2, num_kv_heads=2)  # fmt: skip
    model = Decoder(cfg)
    model.init_weights(seed=seed)
    with torch.no_grad():  # weights of a trained model's scale, so logits are not a near-tie everywhere
        for name, p in model.named_parameters():
            if name.endswith("proj.weight") or name == "embed_tokens.weight":
                p.mul_(4)
    return model.eval()


@pytest.fixture(scope="module")
def model_and_folder(tmp_path_factory):
    model = _tiny()
    folder = tmp_path_factory.mktemp("quant") / "tiny"
    save_model(model, folder)
    shutil.copytree(TOKENIZER, folder, dirs_exist_ok=True)
    return model, folder


def _greedy(model, tokenizer, defaults, new: int = 8) -> list[list[int]]:
    engine = Engine(model, tokenizer, None, defaults)
    params = [SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)] * len(PROMPTS)
    return [c[0].tokens for c in engine.generate(PROMPTS, params)]


def _within_kernel_rounding(y: torch.Tensor, reference: torch.Tensor) -> None:
    """The kernels accumulate in fp32 and round their product to bf16 once: half a bf16 step of each value
    (2^-9 relative), with room for the order of the sums (measured: within 2e-7 of 2^-8 relative)."""
    bound = reference.abs() * 2**-8 + 1e-5 * reference.abs().max()
    assert ((y - reference).abs() <= bound).all(), (y - reference).abs().max()


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_the_quantized_linear_is_its_dequantized_matmul(scheme):
    from torchao.prototype.quantization.int4.int4_opaque_tensor import Int4OpaqueTensor
    from torchao.quantization.granularity import PerRow
    from torchao.quantization.quantize_.workflows.int8.int8_tensor import Int8Tensor
    from torchao.quantization.utils import unpack_tinygemm_scales_and_zeros

    linear = nn.Linear(128, 48, bias=True)
    x = torch.randn(3, 5, 128)
    if scheme == "int8":
        weight = Int8Weight.of(linear.weight)
        ao = Int8Tensor.from_hp(linear.weight.detach(), granularity=PerRow())  # torchao's own numbers
        torch.testing.assert_close(weight.dequantized(), ao.dequantize().float(), rtol=0, atol=0)
    else:
        weight = Int4Weight.of(linear.weight, GROUP)
        ao = Int4OpaqueTensor.from_hp(linear.weight.detach(), [1, GROUP])  # torchao's CPU int4, fp32 numbers
        scale, zero = unpack_tinygemm_scales_and_zeros(ao.scale_and_zero)
        torch.testing.assert_close(weight.scale, scale.squeeze(-1).reshape(48, -1), rtol=0, atol=0)
        torch.testing.assert_close(weight.zero, zero.squeeze(-1).reshape(48, -1), rtol=0, atol=0)
        layer = QuantizedLinear(weight, None, torch.float32, torch.device("cpu"))
        assert torch.equal(layer.qweight, ao.qdata)  # the same packed bytes
    layer = QuantizedLinear(weight, None, torch.float32, torch.device("cpu"))
    product = layer(x)
    _within_kernel_rounding(product, linear_reference(x, weight))
    y = QuantizedLinear(weight, linear.bias, torch.float32, torch.device("cpu"))(x)
    assert y.dtype == torch.float32 and y.shape == (3, 5, 48)
    torch.testing.assert_close(y, product + linear.bias, rtol=0, atol=0)
    # and the quantization itself is close to the full-precision linear
    assert (y - linear(x)).abs().max() < (0.02 if scheme == "int8" else 0.15) * linear(x).abs().max()


def test_an_int8_model_decodes_the_fp32_tokens_and_packs_around_them(model_and_folder):
    _, folder = model_and_folder
    full = load_for_inference(folder)
    expected = _greedy(full.model, full.tokenizer, full.defaults)
    loaded = load_for_inference(folder, quantize=Quantization("int8"))
    attn, mlp = loaded.model.layers[0].attn, loaded.model.layers[0].mlp
    assert isinstance(attn.qkv, QuantizedLinear) and attn.qkv.sizes == [64, 32, 32] and attn.q_proj is None
    assert isinstance(mlp.gate_up, QuantizedLinear) and isinstance(loaded.model.lm_head, QuantizedLinear)
    assert isinstance(loaded.model.embed_tokens.weight, nn.Parameter)  # the lookup table stays as it was
    with torch.no_grad():
        logits, reference = loaded.model(IDS), full.model(IDS)
    assert (logits - reference).abs().max() < 0.05 * reference.abs().max()
    undo = inference_layout(loaded.model)  # the engine's layout leaves quantized linears alone
    assert isinstance(loaded.model.layers[0].attn.qkv, QuantizedLinear)
    assert _greedy(loaded.model, loaded.tokenizer, loaded.defaults) == expected
    restore(undo)


def test_int4_groups_and_what_does_not_fit(model_and_folder):
    _, folder = model_and_folder
    full = load_for_inference(folder)
    loaded = load_for_inference(folder, quantize=Quantization("int4", GROUP))
    assert loaded.model.layers[1].mlp.down_proj.group == GROUP
    with torch.no_grad():
        logits, reference = loaded.model(IDS), full.model(IDS)
    assert (logits - reference).abs().max() < 0.4 * reference.abs().max()  # 4 bits on a random model
    dequantized = _tiny()  # the model whose weights are int4's, as the layers hold their scales and zeros
    with torch.no_grad():
        for module in dequantized.modules():
            if isinstance(module, nn.Linear):
                w = Int4Weight.of(module.weight, GROUP)
                held = Int4Weight(w.q, w.scale.bfloat16().float(), w.zero.bfloat16().float(), GROUP)
                module.weight.copy_(held.dequantized())
        expected = dequantized(IDS)
    assert (logits - expected).abs().max() < 0.05 * expected.abs().max()
    assert (logits.argmax(-1) == expected.argmax(-1)).float().mean() >= 0.9
    with pytest.raises(ConfigError, match=r"--group-size 256.*try --group-size 32 or 64"):
        quantize_for_inference(_tiny(), Quantization("int4", 256))  # its inputs are 64 and 128 wide
    with pytest.raises(ConfigError, match="--group-size 48: int4 groups are one of 32, 64, 128, 256"):
        Quantization("int4", 48).check()
    with pytest.raises(ConfigError, match="--quantize 'int3' is not one of int8, int4"):
        Quantization("int3").check()


# ---- checkpoints as AutoAWQ and AutoGPTQ write them, built here from the tiny model ----


def _groupwise(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric 4-bit groups along the inputs, fp16 scales (as both tools store them): q [N, K] in 0..15,
    scale and integer zero [N, K / group]."""
    g = w.float().view(w.shape[0], -1, group)
    low, high = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
    scale = ((high - low).clamp_min(1e-5) / 15).half()
    zero = torch.round(-low / scale.float()).clamp(0, 15)
    q = torch.round(g / scale.float()[..., None] + zero[..., None]).clamp(0, 15).to(torch.int32)
    return q.view_as(w), scale, zero.to(torch.int32)


def _dequantized(
    q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, g_idx: torch.Tensor
) -> torch.Tensor:
    """The formats' one formula: w[n, k] = scale[n, g(k)] x (q[n, k] - zero[n, g(k)])."""
    return scale.float()[:, g_idx.long()] * (q - zero[:, g_idx.long()]).float()


def _pack_awq(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> dict[str, torch.Tensor]:
    """AutoAWQ's GEMM pack: qweight [K, N / 8] and qzeros [G, N / 8], eight columns an int32 in AWQ_ORDER."""

    def pack(values: torch.Tensor) -> torch.Tensor:  # [R, C] -> [R, C / 8]
        out = torch.zeros(values.shape[0], values.shape[1] // 8, dtype=torch.int32)
        for col in range(out.shape[1]):
            for i in range(8):
                out[:, col] |= values[:, col * 8 + AWQ_ORDER[i]] << (i * 4)
        return out

    return {
        "qweight": pack(q.t().contiguous()),
        "qzeros": pack(zero.t().contiguous()),
        "scales": scale.t().contiguous(),
    }


def _pack_gptq(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, g_idx: torch.Tensor) -> dict:
    """AutoGPTQ's pack (`gptq` checkpoint format): qweight [K / 8, N] along the inputs, qzeros [G, N / 8]
    along the outputs holding zero - 1, g_idx [K]."""
    intweight = q.t().contiguous()  # [K, N]
    qweight = torch.zeros(intweight.shape[0] // 8, intweight.shape[1], dtype=torch.int32)
    for row in range(qweight.shape[0]):
        for j in range(8):
            qweight[row] |= intweight[row * 8 + j] << (4 * j)
    zeros = (zero.t() - 1).contiguous()  # [G, N]
    qzeros = torch.zeros(zeros.shape[0], zeros.shape[1] // 8, dtype=torch.int32)
    for col in range(qzeros.shape[1]):
        for j in range(8):
            qzeros[:, col] |= (zeros[:, col * 8 + j] & 15) << (4 * j)
    return {
        "qweight": qweight,
        "qzeros": qzeros,
        "scales": scale.t().contiguous(),
        "g_idx": g_idx.to(torch.int32),
    }


def _quantized_folder(
    model: Decoder, folder, method: str, act_order: bool = False
) -> dict[str, torch.Tensor]:
    """`model` written as an AWQ or GPTQ folder (the block linears packed, the rest fp16 as published);
    returns the full-precision weights its packed ones stand for, by HF name."""
    hf = hf_state_dict(model)
    tensors, dequantized = {}, {}
    generator = torch.Generator().manual_seed(1)
    for key, w in hf.items():
        if not (key.startswith("model.layers.") and key.endswith("proj.weight")):
            tensors[key] = w.half()
            continue
        module = key.removesuffix(".weight")
        k = w.shape[1]
        if act_order:  # GPTQ's desc_act: the columns quantized in another order, each group holds GROUP
            order = torch.randperm(k, generator=generator)
            g_idx = torch.empty(k, dtype=torch.int64)
            g_idx[order] = torch.arange(k) // GROUP
        else:
            g_idx = torch.arange(k) // GROUP
        gathered = torch.stack([w[:, g_idx == g] for g in range(k // GROUP)], 1).reshape(w.shape)
        q_sorted, scale, zero = _groupwise(gathered, GROUP)
        q = torch.empty_like(q_sorted)  # back to the model's column order
        for g in range(k // GROUP):
            q[:, g_idx == g] = q_sorted[:, g * GROUP : (g + 1) * GROUP]
        parts = _pack_awq(q, scale, zero) if method == "awq" else _pack_gptq(q, scale, zero, g_idx)
        tensors.update({f"{module}.{leaf}": t for leaf, t in parts.items()})
        dequantized[module] = _dequantized(q, scale, zero, g_idx)
    folder.mkdir(parents=True)
    save_file(tensors, str(folder / "model.safetensors"))
    config = json.loads((_saved_config(model, folder.parent / f"{folder.name}-plain")).read_text())
    if method == "awq":
        config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": GROUP,
                                         "zero_point": True, "version": "gemm"}  # fmt: skip
    else:
        config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": GROUP,
                                         "desc_act": act_order, "sym": False,
                                         "checkpoint_format": "gptq"}  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config))
    shutil.copytree(TOKENIZER, folder, dirs_exist_ok=True)
    return dequantized


def _saved_config(model: Decoder, folder):
    save_model(model, folder)
    return folder / "config.json"


def _reference(model: Decoder, dequantized: dict[str, torch.Tensor]) -> Decoder:
    """The tiny model with its block linears as the checkpoint's dequantized weights, the rest rounded to
    fp16."""
    copy = _tiny()
    copy.load_state_dict(model.state_dict())
    with torch.no_grad():
        for p in copy.parameters():
            p.copy_(p.half().float())
        for module, w in dequantized.items():
            ours = module.removeprefix("model.").replace("self_attn", "attn")
            copy.get_submodule(ours).weight.copy_(w)
    return copy


@pytest.mark.parametrize(("method", "act_order"), [("awq", False), ("gptq", False), ("gptq", True)])
def test_awq_and_gptq_folders_load_as_their_formats_say(tmp_path, method, act_order):
    model = _tiny(seed=3)
    folder = tmp_path / method
    dequantized = _quantized_folder(model, folder, method, act_order)
    # the unpacking, one linear: exactly the format's formula
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        name = "model.layers.0.mlp.down_proj"
        parts = {leaf: f.get_tensor(f"{name}.{leaf}") for leaf in ("qweight", "qzeros", "scales", "g_idx")
                 if f"{name}.{leaf}" in set(f.keys())}  # fmt: skip
    fmt = Format(method, GROUP, zeros_less_one=method == "gptq")
    weight = gptq_weight(parts, fmt, name) if method == "gptq" else awq_weight(parts, fmt)
    assert (weight.perm is not None) == act_order
    torch.testing.assert_close(weight.dequantized(), dequantized[name], rtol=1e-6, atol=1e-6)
    # the whole model: its logits are the dequantized model's, to the kernels' bf16 activations
    loaded = load_for_inference(folder)
    attn = loaded.model.layers[0].attn
    if act_order:  # q, k and v in their own column orders here: each its own layer
        assert attn.qkv is None and isinstance(attn.q_proj, QuantizedLinear) and attn.q_proj.perm is not None
    else:
        assert isinstance(attn.qkv, QuantizedLinear)  # q/k/v fused
    reference = _reference(model, dequantized)
    with torch.no_grad():
        logits, expected = loaded.model(IDS), reference(IDS)
    assert (logits - expected).abs().max() < 0.02 * expected.abs().max()
    assert (logits.argmax(-1) == expected.argmax(-1)).float().mean() >= 0.9
    with pytest.raises(ConfigError, match=r"--quantize int8: .* is quantized already .*quant_method='"):
        load_for_inference(folder, quantize=Quantization("int8"))


def _with_config(folder, change: dict) -> None:
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"].update(change)
    (folder / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(
    ("method", "change", "named"),
    [
        ("gptq", {"bits": 8}, r"quantization_config.bits = 8 is not supported \(loads: 4\)"),
        (
            "awq",
            {"version": "gemv"},
            r"quantization_config.version = 'gemv' is not supported \(loads: gemm\)",
        ),
        ("gptq", {"group_size": 16}, r"quantization_config.group_size = 16"),
        ("gptq", {"checkpoint_format": "marlin"}, r"checkpoint_format = 'marlin'"),
        ("gptq", {"quant_method": "aqlm"}, r"quant_method = 'aqlm' is not supported \(loads: awq, gptq, fp8"),
    ],
)
def test_unsupported_quantized_folders_are_refused_by_name(tmp_path, method, change, named):
    folder = tmp_path / method
    _quantized_folder(_tiny(), folder, method)
    _with_config(folder, change)
    with pytest.raises(ModelError, match=named):
        load_for_inference(folder)


def test_gptq_groups_of_unequal_sizes_are_refused(tmp_path):
    folder = tmp_path / "gptq"
    _quantized_folder(_tiny(), folder, "gptq", act_order=True)
    from safetensors.torch import load_file

    tensors = load_file(str(folder / "model.safetensors"))
    g_idx = tensors["model.layers.0.mlp.up_proj.g_idx"]
    g_idx[0] = 1 - g_idx[0].clamp(max=1)  # one input moved to another group
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(ModelError, match=r"up_proj.g_idx: groups of unequal sizes"):
        load_for_inference(folder)


def _fp8_folder(model: Decoder, folder) -> dict[str, torch.Tensor]:
    """compressed-tensors' float-quantized format: fp8 e4m3 block linears, one scale per output channel,
    dynamic per-token activations (what llm-compressor's FP8_DYNAMIC writes)."""
    tensors, dequantized = {}, {}
    for key, w in hf_state_dict(model).items():
        if not (key.startswith("model.layers.") and key.endswith("proj.weight")):
            tensors[key] = w.bfloat16()
            continue
        scale = w.abs().amax(1, keepdim=True) / 448
        w8 = (w / scale).to(torch.float8_e4m3fn)
        tensors[key], tensors[key.replace(".weight", ".weight_scale")] = w8, scale.bfloat16()
        dequantized[key.removesuffix(".weight")] = w8.float() * scale.bfloat16().float()
    folder.mkdir(parents=True)
    save_file(tensors, str(folder / "model.safetensors"))
    config = json.loads(_saved_config(model, folder.parent / "fp8-plain").read_text())
    group = {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "channel"},
             "input_activations": {"num_bits": 8, "type": "float", "strategy": "token",
                                   "dynamic": True}}  # fmt: skip
    config["quantization_config"] = {"quant_method": "compressed-tensors", "format": "float-quantized",
                                     "config_groups": {"group_0": group}, "ignore": ["lm_head"]}  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config))
    shutil.copytree(TOKENIZER, folder, dirs_exist_ok=True)
    return dequantized


def test_an_fp8_folder_loads_where_fp8_matmul_runs_and_is_refused_where_not(tmp_path, monkeypatch):
    from shardforge.infer import prequantized

    model = _tiny(seed=5)
    dequantized = _fp8_folder(model, tmp_path / "fp8")
    if prequantized.fp8_supported(torch.device("cpu")):  # torch's CPU build runs _scaled_mm here
        loaded = load_for_inference(tmp_path / "fp8")
        reference = _reference(model, dequantized)
        with torch.no_grad():
            logits, expected = loaded.model(IDS), reference(IDS)
        # the activations are rounded to fp8 (3 mantissa bits) per call, as vLLM's dynamic fp8 does
        assert (logits - expected).abs().max() < 0.1 * expected.abs().max()
        assert (logits.argmax(-1) == expected.argmax(-1)).float().mean() >= 0.75
    monkeypatch.setattr(prequantized, "fp8_supported", lambda device: False)
    with pytest.raises(
        ModelError, match=r"fp8 weights .*compressed-tensors.* need fp8 matmul .*cpu does not run"
    ):
        load_for_inference(tmp_path / "fp8")


def test_the_cli_refuses_bad_quantization_flags(model_and_folder, tmp_path, capsys):
    _, folder = model_and_folder
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "hi"}) + "\n")
    base = ["generate", str(folder), "--prompts", str(prompts), "--out", str(tmp_path / "o.jsonl")]
    assert main([*base, "--group-size", "64"]) != 0
    assert "--group-size goes with --quantize int4" in capsys.readouterr().err
    assert main([*base, "--quantize", "int8", "--tp", "2"]) != 0
    assert "--quantize int8 with --tp 2" in capsys.readouterr().err
    assert main([*base, "--quantize", "int4", "--group-size", "100"]) != 0
    assert "--group-size 100" in capsys.readouterr().err


@pytest.mark.slow
def test_generate_quantize_int8_on_a_saved_model(model_and_folder, tmp_path):
    _, folder = model_and_folder
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt_ids": p}) + "\n" for p in PROMPTS))
    outs = {}
    for flags in ([], ["--quantize", "int8"]):
        out = tmp_path / f"out{len(flags)}.jsonl"
        argv = ["generate", str(folder), "--prompts", str(prompts), "--out", str(out), "--temperature", "0",
                "--max-tokens", "8", *flags]  # fmt: skip
        assert main(argv) == 0
        outs[len(flags)] = [
            json.loads(line)["completions"][0]["tokens"] for line in out.read_text().splitlines()
        ]
    assert outs[2] == outs[0]  # int8's greedy tokens are fp32's on this model


@pytest.mark.slow
def test_a_qlora_run_serves(tmp_path):
    """A QLoRA run (model.quantize: nf4 + LoRA) serves: its final adapter merges into the full-precision
    base (peft's merge), its checkpoint's NF4 base is dequantized by the merge; both generate."""
    import yaml
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from shardforge.config import load_config
    from shardforge.train.trainer import train
    from tests.conftest import alpaca_records, tiny_config, write_jsonl
    from tests.dist._training import tiny_model_folder

    model = tiny_model_folder(tmp_path / "base", 1024, seed=4, num_layers=2, num_kv_heads=2)
    data = write_jsonl(tmp_path / "d.jsonl", alpaca_records(16, seed=3))
    lora = {"finetuning": "lora", "lora": {"rank": 4, "alpha": 8.0, "targets": "all"}}
    cfg = tiny_config(tmp_path / "qlora", data, method=lora, train={"steps": 2, "lr": 1e-2},
                      checkpoint={"every": 2})  # fmt: skip
    cfg["model"] = {**model, "quantize": "nf4"}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    train(load_config(tmp_path / "c.yaml"))
    run = tmp_path / "qlora" / "run"
    reference = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model["path"]), run / "final")
    expected = reference.merge_and_unload().eval()(IDS).logits.detach()
    served = load_for_inference(run)
    with torch.no_grad():
        torch.testing.assert_close(served.model(IDS), expected, rtol=1e-4, atol=1e-4)
    checkpoint = next(p for p in sorted((run / "checkpoints").iterdir()) if p.is_dir())
    from_nf4 = load_for_inference(checkpoint)
    with torch.no_grad():
        nf4_logits = from_nf4.model(IDS)
    assert (nf4_logits - expected).abs().max() < 0.2 * expected.abs().max()  # NF4 rounding of the base
    for loaded in (served, from_nf4):
        assert all(len(t) == 4 for t in _greedy_n(loaded, 4))
    quantized = load_for_inference(run, quantize=Quantization("int8"))  # and it quantizes for serving
    assert isinstance(quantized.model.lm_head, QuantizedLinear)


def _greedy_n(loaded, new: int) -> list[list[int]]:
    return _greedy(loaded.model, loaded.tokenizer, loaded.defaults, new)
