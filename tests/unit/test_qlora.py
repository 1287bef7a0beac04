"""QLoRA: the base's block linears in NF4 (about a quarter of bf16 with their scales), quantized as they are
read; LoRA over it trains close to LoRA over the bf16 base; the merged export puts the adapters into the
dequantized base in the base's dtype and computes what the live model does; what cannot work is refused."""

from __future__ import annotations

import pytest
import torch

from shardforge import load_model
from shardforge.adapters.apply import add_lora
from shardforge.adapters.lora import LoRALinear
from shardforge.adapters.peft_format import merged_state
from shardforge.config import load_config
from shardforge.config.method_schema import LoraSection
from shardforge.errors import ConfigError
from shardforge.models.quantize import NF4_LEVELS, QUANTIZED, is_nf4, nf4, nf4_storage_bytes
from shardforge.parallel.memory import memory_report
from shardforge.train.trainer import Trainer
from tests.conftest import alpaca_records, tiny_config, write_jsonl
from tests.dist._training import tiny_model_folder


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> dict:
    folder = tmp_path_factory.mktemp("qlora")
    return tiny_model_folder(folder, 1024, seed=4, num_layers=2, num_kv_heads=2, family="llama")


def test_the_nf4_base_is_a_quarter_of_bf16_and_only_the_block_linears(base):
    full = load_model(base["path"], dtype=torch.bfloat16)
    quantized = load_model(base["path"], dtype=torch.bfloat16, quantize=True)
    linears = [k for k, _ in full.named_parameters() if QUANTIZED.match(k)]
    assert len(linears) == 2 * 7
    for key, param in quantized.named_parameters():
        assert is_nf4(param) == (key in linears), key
        assert not param.requires_grad or key not in linears  # a 4-bit weight is frozen
    bf16 = sum(p.numel() * 2 for k, p in full.named_parameters() if k in linears)
    others = sum(p.numel() * 2 for k, p in full.named_parameters() if k not in linears)
    nf4 = memory_report(quantized)["param_bytes"] - others
    assert 0.25 < nf4 / bf16 < 0.30  # 4 bits + an 8-bit scale per 64 values + fp32 factors per scale block
    # the planner's count of the same storage, from the shapes alone
    planned = sum(nf4_storage_bytes(p.numel(), 2) for k, p in full.named_parameters() if k in linears)
    assert planned == nf4
    ids = torch.randint(0, 1000, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # NF4 is lossy but close: measured 12% relative error of the logits, cosine 0.993
        a, b = full(ids).float(), quantized(ids).float()
        assert (a - b).norm() < 0.2 * a.norm()
        assert torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0) > 0.98


def _codes(tensor: torch.Tensor) -> torch.Tensor:
    packed = tensor.quantized_data
    return torch.stack([packed >> 4, packed & 15], dim=-1).flatten()


@pytest.mark.parametrize("shape", [(256, 64), (96, 192), (1024, 2816)])
def test_our_nf4_quantizer_writes_what_torchaos_to_nf4_writes(shape):
    """The chunked midpoint search gives torchao's codes, scales, factors and levels, bit for bit, on fp32
    (torchao's own arithmetic is exact there). An all-zero block dequantizes to zeros (torchao's 0/0 picks
    level -1 there, times a scale that double quantization leaves near but not at zero)."""
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

    weight = torch.randn(shape, generator=torch.Generator().manual_seed(sum(shape))) * 0.02
    weight[0, :64] = 0.0
    ours = nf4(weight)
    theirs = to_nf4(weight, 64, ours.scaler_block_size)
    assert torch.equal(ours.quantized_data[32:], theirs.quantized_data[32:])  # past the zero block
    for name in ("quantized_scalers", "quantization_factor", "scaler_mean", "nf4"):
        a, b = getattr(ours, name), getattr(theirs, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert torch.equal(ours.get_original_weight()[0, :64], torch.zeros(64))
    assert (ours.shape, ours.dtype, ours.requires_grad) == (weight.shape, weight.dtype, False)


def test_each_bf16_value_takes_its_nearest_nf4_level():
    """On bf16 our search runs in fp32 (torchao's in bf16, so it differs on ~0.2% of values, near midpoints):
    every code is a level nearest to the value over its block's scale."""
    weight = (torch.randn(128, 256, generator=torch.Generator().manual_seed(1)) * 0.02).bfloat16()
    blocks = weight.view(-1, 64).float()
    scaled = (blocks / blocks.abs().amax(dim=1, keepdim=True)).flatten()
    levels = NF4_LEVELS.bfloat16().float()
    distance = (scaled[:, None] - levels).abs()
    chosen = distance.gather(1, _codes(nf4(weight)).long()[:, None]).squeeze(1)
    assert torch.all(chosen <= distance.min(dim=1).values + 1e-7)


def test_the_merged_export_of_qlora_is_the_live_model_in_the_base_dtype(base):
    model = load_model(base["path"], quantize=True).eval()
    add_lora(model, LoraSection(rank=4, dora=True, targets=["q_proj", "down_proj"]), seed=0)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, LoRALinear):
                module.lora_B.normal_(0, 0.05)
    ids = torch.randint(0, 1000, (2, 12), generator=torch.Generator().manual_seed(0))
    plain = load_model(base["path"]).eval()
    merged = merged_state(model, model.state_dict())
    assert not any(is_nf4(t) for t in merged.values())
    assert merged["layers.0.mlp.up_proj.weight"].dtype == torch.float32  # the base's dtype
    plain.load_state_dict(merged)
    with torch.no_grad():
        assert (plain(ids) - model(ids)).abs().max().item() < 1e-4


def _run(tmp_path, name: str, base: dict, quantize: str) -> list[float]:
    data = write_jsonl(tmp_path / "train.jsonl", alpaca_records(40, seed=3))
    cfg = tiny_config(
        tmp_path / name,
        data,
        method={"finetuning": "lora", "lora": {"rank": 8, "alpha": 16.0}},
        train={"steps": 4, "lr": 1e-2, "precision": "bf16"},
        checkpoint={"save_final": False},
    )
    cfg["model"] = {**base, "dtype": "bfloat16", "quantize": quantize}
    return [r["loss"] for r in Trainer(load_config(None, base=cfg)).train().history]


def test_qlora_trains_close_to_lora_on_the_bf16_base(tmp_path, base):
    """Tolerance: NF4 moves each base weight by up to ~1/14 of its block's largest value, which moves this
    model's first loss by a few 1e-3 (measured); the adapters then learn alike (each loss within 2%), and
    both runs actually learn (the loss drops)."""
    lora, qlora = _run(tmp_path, "bf16", base, "none"), _run(tmp_path, "nf4", base, "nf4")
    assert qlora[0] == pytest.approx(lora[0], abs=0.02)
    assert qlora == pytest.approx(lora, rel=0.02)
    assert lora[-1] < lora[0] - 0.05 and qlora[-1] < qlora[0] - 0.05


def test_what_qlora_cannot_do_is_refused(tmp_path):
    base = {"model": {"preset": "tiny-llama", "tokenizer": "t"}, "data": {"train": [{"path": "x.jsonl"}]}}
    full = r"model.quantize=nf4 freezes .* set method.finetuning=lora or oft \(it is full\)"
    with pytest.raises(ConfigError, match=full):
        load_config(None, ["model.quantize=nf4"], base=base)
    with pytest.raises(ConfigError, match=r"model.quantize=nf4 with parallel.tp=2"):
        load_config(None, ["model.quantize=nf4", "method.finetuning=lora", "parallel.tp=2"], base=base)
