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
    ours.load_state_dict(theirs.state_dict())  # the same names and shapes, one to one
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
    used = ours.routing.experts.unique().numel()
    assert used < experts or experts == 8  # at 64 experts, 14 tokens x 2 leave most without a token
