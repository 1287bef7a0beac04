"""The MoE families (Mixtral, Qwen2-MoE, Qwen3-MoE) as whole models: transformers' logits from our export in
both expert layouts, our loading of transformers' own saves in both, the balancing losses against their
published formulas (transformers' load_balancing_loss_func per layer, ST-MoE's z-loss), the aux-loss-free
bias, capacity dropping, and the routing statistics a training run logs."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

from shardforge.config import load_config
from shardforge.config.method_schema import MoESection
from shardforge.errors import ModelError
from shardforge.models import build_preset, save_model
from shardforge.models.io import load_model
from shardforge.models.moe import Balance, MoEShape, SparseMoE, moe_layers
from shardforge.parallel.dims import ParallelDims
from shardforge.train.moe import MoEBalancer
from shardforge.train.trainer import Trainer
from tests.conftest import alpaca_records, tiny_config, write_jsonl

VOCAB = 300
PER_EXPERT_KEY = {
    "tiny-mixtral": "model.layers.1.block_sparse_moe.experts.7.w3.weight",
    "tiny-qwen2-moe": "model.layers.1.mlp.experts.7.up_proj.weight",
    "tiny-qwen3-moe": "model.layers.1.mlp.experts.7.up_proj.weight",
}


def _keys(folder) -> set[str]:
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        return set(f.keys())


@pytest.mark.parametrize("preset", list(PER_EXPERT_KEY))
def test_both_expert_layouts_round_trip_through_transformers(preset, tmp_path):
    torch.manual_seed(0)
    ours = build_preset(preset, vocab_size=VOCAB, seed=1)
    ids = torch.randint(0, VOCAB, (2, 11))
    with torch.no_grad():
        expected = ours(ids)
    for layout in ("per_expert", "fused"):
        folder = save_model(ours, tmp_path / layout, expert_layout=layout)
        keys = _keys(folder)
        assert (PER_EXPERT_KEY[preset] in keys) == (layout == "per_expert"), layout
        assert ("model.layers.1.mlp.experts.gate_up_proj" in keys) == (layout == "fused"), layout
        assert not any(k.endswith("gate.bias") for k in keys)  # the balancing bias is ours alone
        theirs = AutoModelForCausalLM.from_pretrained(folder).eval()
        with torch.no_grad():
            torch.testing.assert_close(theirs(ids).logits, expected, rtol=0, atol=1e-4)
            torch.testing.assert_close(load_model(folder)(ids), expected, rtol=0, atol=0)
        for original in (True, False):  # what transformers writes, each way: ours reads it
            saved = tmp_path / f"{layout}-hf-{original}"
            theirs.save_pretrained(saved, save_original_format=original)
            with torch.no_grad():
                torch.testing.assert_close(load_model(saved)(ids), expected, rtol=0, atol=1e-6)
    if preset == "tiny-qwen2-moe":  # layer 0 keeps the dense MLP: mlp_only_layers
        assert theirs.config.mlp_only_layers == [0] and hasattr(theirs.model.layers[0].mlp, "gate_proj")
        assert theirs.config.shared_expert_intermediate_size == 64


def test_a_missing_expert_is_a_clear_error(tmp_path):
    from safetensors.torch import load_file, save_file

    folder = save_model(build_preset("tiny-mixtral", vocab_size=VOCAB), tmp_path / "m")
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.1.block_sparse_moe.experts.3.w1.weight"]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelError, match=r"missing 1 weight.*layers\.1\.mlp\.experts\.gate_up_proj"):
        load_model(folder)


def _padded_rows():
    """Two rows of one document each, the second with 3 padding positions (position 0 after column 0)."""
    ids = torch.randint(0, VOCAB, (2, 9))
    positions = torch.stack([torch.arange(9), torch.cat([torch.arange(6), torch.zeros(3, dtype=torch.long)])])
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, 6:] = 0
    return ids, positions, mask


def test_balancing_losses_are_the_published_formulas():
    """With loss_weight = 1 / tokens, the attached losses add coef x the mean over layers of transformers'
    load_balancing_loss_func (padding masked out) and z_coef x the mean over layers and tokens of the
    squared log-sum-exp of the router logits: every gradient equals that written out."""
    torch.manual_seed(3)
    aux, z = 0.3, 0.05
    ours = build_preset("tiny-qwen3-moe", vocab_size=VOCAB, seed=2).train()
    reference = build_preset("tiny-qwen3-moe", vocab_size=VOCAB, seed=2).train()
    ids, positions, mask = _padded_rows()
    tokens = int(mask.sum())
    for layer in moe_layers(ours):
        layer.balance = Balance(aux_loss_coef=aux, z_loss_coef=z, layers=2)
        layer.loss_weight = 1.0 / tokens
    logits = []
    for layer in moe_layers(reference):
        layer.gate.register_forward_hook(lambda m, i, out: logits.append(out.logits))
    main = ours(ids, position_ids=positions).logsumexp(-1).sum()
    main.backward()
    ref_main = reference(ids, position_ids=positions).logsumexp(-1).sum()
    real = mask.reshape(-1).bool()
    aux_terms = [load_balancing_loss_func((lg,), 8, 2, mask) for lg in logits]
    z_terms = [torch.logsumexp(lg, -1)[real].pow(2).mean() for lg in logits]
    (ref_main + aux * sum(aux_terms) / 2 + z * sum(z_terms) / 2).backward()
    grads = dict(reference.named_parameters())
    for name, param in ours.named_parameters():
        torch.testing.assert_close(param.grad, grads[name].grad, rtol=1e-5, atol=1e-6, msg=name)
    assert grads["layers.0.mlp.gate.weight"].grad.abs().sum() > 0
    for layer, value, zv in zip(moe_layers(ours), aux_terms, z_terms, strict=True):  # recorded by backward
        picks, (aux_sum, z_sum, n, dropped) = layer.window[:8], layer.window[8:].tolist()
        assert n == tokens and dropped == 0 and picks.sum() == 2 * tokens
        assert aux_sum / n == pytest.approx(value.item(), rel=1e-5)
        assert z_sum / n == pytest.approx(zv.item(), rel=1e-5)


def test_expert_bias_steers_the_choice_but_not_the_weights():
    torch.manual_seed(0)
    moe = SparseMoE(MoEShape(16, 8, 4, 2, False))
    torch.nn.init.normal_(moe.gate.weight)
    x = torch.randn(32, 16)
    plain = moe.gate(x)
    moe.gate.bias[3] = 10.0  # expert 3 is now chosen by every token, with its unbiased probability
    steered = moe.gate(x)
    assert (steered.experts == 3).any(-1).all() and not (plain.experts == 3).any(-1).all()
    probs = torch.softmax(x @ moe.gate.weight.detach().T, -1)
    torch.testing.assert_close(steered.weights, probs.gather(-1, steered.experts))
    # The step's update moves each bias towards an even load, by the rate, on every rank alike.
    model = torch.nn.Sequential(moe)
    dims = ParallelDims(1, 1, 1, 1, 1, 1, 0, 1)
    config = type("C", (), {"num_experts": 4, "experts_per_token": 2, "router_aux_loss_coef": 0.0,
                            "moe_layers": [0]})()  # fmt: skip
    balancer = MoEBalancer(model, MoESection(balance="bias", bias_rate=0.5), config, dims)
    moe.gate.bias.zero_()
    moe.step_picks = torch.tensor([10.0, 2.0, 6.0, 6.0])
    balancer.end_step(lambda t: t)
    assert moe.gate.bias.tolist() == [-0.5, 0.5, 0.0, 0.0] and moe.step_picks is None


def test_capacity_keeps_each_experts_first_choices():
    """capacity_factor c keeps ceil(c x tokens x k / E) choices per expert, the earliest tokens first; the
    dropped choices add nothing to their tokens."""
    torch.manual_seed(1)
    moe = SparseMoE(MoEShape(16, 8, 4, 2, True)).train()
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.5)
    moe.balance = Balance(capacity_factor=0.5, layers=1)
    x = torch.randn(20, 16)
    out = moe(x)
    routing = moe.gate(x)
    capacity, seen, expected, dropped = 5, [0] * 4, torch.zeros_like(x), 0  # ceil(0.5 * 20 * 2 / 4)
    w1, w2 = moe.experts.gate_up_proj, moe.experts.down_proj
    for t in range(20):
        for e, w in zip(routing.experts[t].tolist(), routing.weights[t], strict=True):
            seen[e] += 1
            if seen[e] > capacity:
                dropped += 1
                continue
            gate, up = (w1[e] @ x[t]).chunk(2)
            expected[t] += w * (w2[e] @ (torch.nn.functional.silu(gate) * up))
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    out.sum().backward()
    assert dropped > 0 and moe.window[4 + 3].item() == dropped


def test_training_logs_routing_statistics(tmp_path):
    data = write_jsonl(tmp_path / "train.jsonl", alpaca_records(40, seed=1))
    records = {}
    for name, moe in {"aux": {}, "bias": {"balance": "bias"}, "capacity": {"capacity_factor": 0.5}}.items():
        cfg = tiny_config(
            tmp_path / name, data, model={"preset": "tiny-mixtral"}, method={"moe": moe},
            train={"steps": 2, "micro_batch": 4, "lr": 3e-3, "warmup": 1, "log_every": 1},
            checkpoint={"save_final": False},
        )  # fmt: skip
        trainer = Trainer(load_config(None, base=cfg))
        records[name] = trainer.train().history[-1]
        if name == "bias":
            biases = [layer.gate.bias for layer in moe_layers(trainer.engine.inner)]
            assert all(0 < b.abs().max() <= 2 * 1e-3 + 1e-9 for b in biases)  # two steps at the default rate
    aux = records["aux"]
    assert aux["moe_aux_loss"] > 1.0 and aux["moe_load_max"] >= 1.0 >= aux["moe_load_min"]
    assert aux["moe_dropped"] == 0.0 and records["capacity"]["moe_dropped"] > 0.05


def test_qwen_sparse_step_and_dense_layers_load_as_transformers_builds_them(tmp_path):
    """decoder_sparse_step=2 makes layers 1 and 3 sparse, mlp_only_layers=[3] keeps 3 dense: our model has
    dense MLPs exactly where transformers does, the same logits, and exports the same layer set."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
        decoder_sparse_step=2, mlp_only_layers=[3],
    )  # fmt: skip
    torch.manual_seed(0)
    theirs = Qwen3MoeForCausalLM(config).eval()
    theirs.save_pretrained(tmp_path / "hf")
    ours = load_model(tmp_path / "hf")
    assert [type(b.mlp).__name__ for b in ours.layers] == ["MLP", "SparseMoE", "MLP", "MLP"]
    ids = torch.randint(0, VOCAB, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), theirs(ids).logits, rtol=0, atol=1e-4)
    exported = AutoModelForCausalLM.from_pretrained(save_model(ours, tmp_path / "ours")).eval()
    with torch.no_grad():
        torch.testing.assert_close(exported(ids).logits, theirs(ids).logits, rtol=0, atol=1e-5)
