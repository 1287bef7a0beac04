"""The mixture-of-experts MLP against transformers' own blocks (Mixtral, Qwen2-MoE with its shared expert,
Qwen3-MoE with and without norm_topk_prob), the same weights under the same names: outputs and the gradients
of the input and of every parameter, at 8 and 64 experts (most of the 64 receive no token)."""

from __future__ import annotations

import pytest
import torch

from shardforge.models.moe import MoEShape, SparseMoE

H, WIDTH, SHARED = 32, 48, 40


def _hf_block(family: str, experts: int, renormalize: bool):
    common = {"hidden_size": H, "num_experts_per_tok": 2}
    if family == "mixtral":
        from transformers import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

        return MixtralSparseMoeBlock(
            MixtralConfig(**common, intermediate_size=WIDTH, num_local_experts=experts)
        )
    if family == "qwen2_moe":
        from transformers import Qwen2MoeConfig
        from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

        config = Qwen2MoeConfig(
            **common, moe_intermediate_size=WIDTH, num_experts=experts, norm_topk_prob=renormalize,
            shared_expert_intermediate_size=SHARED,
        )  # fmt: skip
        return Qwen2MoeSparseMoeBlock(config)
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    config = Qwen3MoeConfig(
        **common, moe_intermediate_size=WIDTH, num_experts=experts, norm_topk_prob=renormalize
    )
    return Qwen3MoeSparseMoeBlock(config)


@pytest.mark.parametrize("experts", [8, 64])
@pytest.mark.parametrize(
    ("family", "renormalize"),
    [("mixtral", True), ("qwen2_moe", False), ("qwen3_moe", True), ("qwen3_moe", False)],
)
def test_sparse_moe_equals_transformers(family, renormalize, experts):
    torch.manual_seed(experts)
    theirs = _hf_block(family, experts, renormalize)
    with torch.no_grad():
        for p in theirs.parameters():
            p.normal_(0.0, 0.2)
    shared = SHARED if family == "qwen2_moe" else 0
    ours = SparseMoE(MoEShape(H, WIDTH, experts, 2, renormalize, shared))
    missing, unexpected = ours.load_state_dict(theirs.state_dict(), strict=False)  # the same names, 1:1
    assert missing == ["gate.bias"] and not unexpected  # ours: the aux-loss-free balancing's bias (zero)
    x = torch.randn(2, 7, H)
    a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_theirs, out_ours = theirs(a), ours(b)
    torch.testing.assert_close(out_ours, out_theirs, rtol=1e-5, atol=1e-6)
    probe = torch.randn_like(out_theirs)
    (out_theirs * probe).sum().backward()
    (out_ours * probe).sum().backward()
    torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-6)
    grads = dict(theirs.named_parameters())
    for name, param in ours.named_parameters():
        torch.testing.assert_close(param.grad, grads[name].grad, rtol=1e-5, atol=1e-6, msg=name)
    used = ours.gate(x.reshape(-1, H)).experts.unique().numel()
    assert used < experts or experts == 8  # at 64 experts, 14 tokens x 2 leave most without a token


def test_load_balancing_loss_is_transformers_and_adds_over_parts():
    """The auxiliary loss equals transformers' load_balancing_loss_func (with and without a padding mask),
    and statistics summed over two halves of the tokens give the loss of the whole."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    from shardforge.models.moe import Router, load_balancing_loss, routing_stats

    torch.manual_seed(0)
    layers = [Router(MoEShape(H, WIDTH, 8, 2, True)) for _ in range(3)]
    for router in layers:
        torch.nn.init.normal_(router.weight, std=0.5)
    x = torch.randn(2 * 9, H)
    mask = (torch.arange(18) % 9 < 7).long().view(2, 9)  # two rows, each with 2 padding tokens
    routings = [router(x) for router in layers]
    logits = tuple(r.logits for r in routings)
    for m in (None, mask):
        expected = load_balancing_loss_func(logits, num_experts=8, top_k=2, attention_mask=m)
        ours = load_balancing_loss(routing_stats(routings, m))
        torch.testing.assert_close(ours, expected, rtol=1e-6, atol=1e-7)
    halves = [[router(part) for router in layers] for part in x.split(9)]
    summed = routing_stats(halves[0]) + routing_stats(halves[1])
    torch.testing.assert_close(load_balancing_loss(summed), load_balancing_loss(routing_stats(routings)))
