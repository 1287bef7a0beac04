"""The RL losses against independent implementations of the published formulas, written here token by token
with plain Python floats: GRPO's group-relative advantages (DeepSeekMath), PPO's clipped surrogate with
DAPO's decoupled clip range, the k3 KL estimator, TRL's three aggregations (grpo, dapo, dr_grpo), the
objective's loss on a hand-made micro-batch divided by the loop's normalizer; and PPO's GAE, clipped value
loss, KL-penalised per-token rewards with whitened advantages, and its combined loss."""

from __future__ import annotations

import math
import statistics
from types import SimpleNamespace

import pytest
import torch

from shardforge.config.method_schema import MethodSection, MoESection, RLSection
from shardforge.data.batching import IGNORE, Batch, collate, collate_groups
from shardforge.data.examples import Example
from shardforge.models import build_preset
from shardforge.models.moe import Balance, moe_layers
from shardforge.objectives.rl import GRPOObjective, PPOObjective
from shardforge.objectives.rl_losses import (
    aggregate,
    clipped_surrogate,
    clipped_value_loss,
    gae,
    group_advantages,
)
from shardforge.objectives.rollout import attention_pairs, rollout_packing

REWARDS = [[1.0, 0.0, 0.0, 1.0], [0.5, 0.5, 0.5, 0.5], [2.0, -1.0, 0.0, 3.0]]


def _reference_advantages(rewards: list[list[float]], scale: str) -> list[list[float]]:
    everything = [r for group in rewards for r in group]
    out = []
    for group in rewards:
        mean = sum(group) / len(group)
        std = {"group": statistics.stdev(group), "batch": statistics.stdev(everything), "none": None}[scale]
        out.append([(r - mean) / (std + 1e-4) if std is not None else r - mean for r in group])
    return out


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_group_advantages_are_grpos(scale):
    got = group_advantages(torch.tensor(REWARDS, dtype=torch.float64), scale).flatten().tolist()
    expected = [a for group in _reference_advantages(REWARDS, scale) for a in group]
    assert got == pytest.approx(expected, rel=1e-12, abs=1e-12)


def _reference_token_loss(logp, old, adv, low, high, beta, ref):
    ratio = math.exp(logp - old)
    clipped = min(max(ratio, 1 - low), 1 + high)
    loss = -min(ratio * adv, clipped * adv)
    kl = math.exp(ref - logp) - (ref - logp) - 1 if ref is not None else 0.0
    return loss + beta * kl, kl, (ratio < 1 - low and adv < 0) or (ratio > 1 + high and adv > 0)


def test_clipped_surrogate_with_clip_higher_and_k3_kl():
    torch.manual_seed(0)
    logp, old, ref = -torch.rand(40) * 3, -torch.rand(40) * 3, -torch.rand(40) * 3
    adv = torch.randn(40)
    t = clipped_surrogate(logp.double(), old.double(), adv.double(), (0.2, 0.28), 0.05, ref.double())
    for i in range(40):
        loss, kl, clipped = _reference_token_loss(
            float(logp[i]), float(old[i]), float(adv[i]), 0.2, 0.28, 0.05, float(ref[i])
        )
        assert float(t.loss[i]) == pytest.approx(loss, rel=1e-9, abs=1e-12)
        assert float(t.kl[i]) == pytest.approx(kl, rel=1e-9, abs=1e-12)
        assert bool(t.clipped[i]) == clipped
    assert t.clipped.any() and not t.clipped.all()  # the case mix covers both


def _reference_aggregate(per_row: list[list[float]], how: str, max_new: int) -> float:
    """TRL's definitions: grpo = mean over sequences of each sequence's token mean; dapo = mean over all
    tokens; dr_grpo = sum over tokens / (sequences x max_completion_length)."""
    if how == "grpo":
        return sum(sum(row) / len(row) for row in per_row) / len(per_row)
    if how == "dapo":
        return sum(map(sum, per_row)) / sum(map(len, per_row))
    return sum(map(sum, per_row)) / (len(per_row) * max_new)


@pytest.mark.parametrize("how", ["grpo", "dapo", "dr_grpo"])
def test_aggregations_divided_by_the_loops_normalizer_are_trls(how):
    per_row = [[0.5, -1.0, 2.0], [1.0], [0.25, 0.25, 3.0, -2.0, 1.0]]
    values = torch.tensor([v for row in per_row for v in row], dtype=torch.float64)
    rows = torch.tensor([r for r, row in enumerate(per_row) for _ in row])
    total = aggregate(values, rows, len(per_row), how, max_new_tokens=8)
    count = sum(map(len, per_row)) if how == "dapo" else len(per_row)  # targets | sequences
    assert float(total) / count == pytest.approx(_reference_aggregate(per_row, how, 8), rel=1e-12)


def _hand_batch() -> tuple[Batch, list[list[int]]]:
    """Two groups of two completions: rows of prompt + completion, targets on the completion only."""
    lengths = [(3, 2), (3, 4), (2, 1), (2, 3)]  # (prompt, completion) tokens per row
    width = max(p + c for p, c in lengths)
    targets = torch.full((4, width), IGNORE)
    ids = torch.zeros(4, width, dtype=torch.long)
    positions = []
    for r, (p, c) in enumerate(lengths):
        ids[r, : p + c] = torch.arange(1, p + c + 1)
        targets[r, p - 1 : p + c - 1] = ids[r, p : p + c]
        positions.append(list(range(p - 1, p + c - 1)))
    batch = Batch(ids, targets, torch.arange(width).expand(4, width), None, 0, 0)
    torch.manual_seed(1)
    batch.extras["old_logps"] = -torch.rand(4, width)
    batch.extras["ref_logps"] = -torch.rand(4, width)
    scored = (targets != IGNORE).float()  # per target position, as assign_advantages places them
    batch.extras["advantages"] = torch.tensor([1.0, -1.0, 0.5, -0.5])[:, None] * scored
    batch.extras["keep"] = torch.tensor([1.0, 1.0, 0.0, 0.0])[:, None] * scored  # the second group filtered
    batch.extras["sampled_logps"] = -torch.rand(4, width)
    return batch, positions


@pytest.mark.parametrize("how", ["grpo", "dapo", "dr_grpo"])
def test_the_objectives_loss_is_the_formula_on_a_hand_made_batch(how):
    rl = RLSection(group_size=2, loss=how, clip=(0.2, 0.28), kl_beta=0.1, max_new_tokens=6)
    objective = GRPOObjective(MethodSection(stage="grpo", rl=rl))
    batch, positions = _hand_batch()
    torch.manual_seed(2)
    logps = -torch.rand(int((batch.targets != IGNORE).sum()))  # the policy's, in row-major target order
    sums = objective.loss(logps, batch)
    per_row, at = [], 0
    for r, cols in enumerate(positions):
        row = []
        for col in cols:
            old, ref = float(batch.extras["old_logps"][r, col]), float(batch.extras["ref_logps"][r, col])
            adv = float(batch.extras["advantages"][r, col])
            loss, _, _ = _reference_token_loss(float(logps[at]), old, adv, 0.2, 0.28, 0.1, ref)
            row.append(loss)
            at += 1
        per_row.append(row)
    kept = per_row[:2]  # the loop's counts exclude the filtered group
    count = sum(map(len, kept)) if how == "dapo" else len(kept)
    assert objective.normalizer == ("targets" if how == "dapo" else "sequences")
    assert float(sums["loss"]) / count == pytest.approx(_reference_aggregate(kept, how, 6), rel=1e-5)


def test_the_clip_range_is_checked():
    with pytest.raises(ValueError, match="clip"):
        RLSection(clip=(1.5, 0.2))


def _reference_gae(rewards: list[float], values: list[float], gamma: float, lam: float) -> list[float]:
    """GAE (Schulman et al. 2016) over one completion: A_t = sum_l (gamma lam)^l delta_{t+l}, with
    delta_t = r_t + gamma V_{t+1} - V_t and V after the last token 0."""
    deltas = [
        r + gamma * (values[t + 1] if t + 1 < len(values) else 0.0) - values[t] for t, r in enumerate(rewards)
    ]
    return [sum((gamma * lam) ** k * d for k, d in enumerate(deltas[t:])) for t in range(len(deltas))]


def test_gae_is_the_discounted_sum_of_td_errors_over_each_rows_completion():
    torch.manual_seed(3)
    mask = torch.zeros(3, 7, dtype=torch.bool)
    spans = [(2, 5), (1, 7), (4, 5)]  # each row's completion columns
    for r, (a, b) in enumerate(spans):
        mask[r, a:b] = True
    rewards, values = torch.randn(3, 7, dtype=torch.float64), torch.randn(3, 7, dtype=torch.float64)
    advantages, returns = gae(rewards, values, mask, gamma=0.9, lam=0.8)
    for r, (a, b) in enumerate(spans):
        expected = _reference_gae(rewards[r, a:b].tolist(), values[r, a:b].tolist(), 0.9, 0.8)
        assert advantages[r, a:b].tolist() == pytest.approx(expected, rel=1e-12)
        assert returns[r, a:b].tolist() == pytest.approx(
            [x + v for x, v in zip(expected, values[r, a:b].tolist(), strict=True)]
        )
        assert not advantages[r, ~mask[r]].any()


def test_the_clipped_value_loss_is_ppos():
    values, old, returns = (
        torch.tensor([1.0, 0.5, -1.0, 2.0]),
        torch.tensor([0.0, 0.4, -0.5, 2.5]),
        torch.tensor([2.0, 0.0, 0.0, 1.0]),
    )
    loss, clipped = clipped_value_loss(values, old, returns, clip=0.2)
    for i in range(4):
        v, o, ret = float(values[i]), float(old[i]), float(returns[i])
        vc = min(max(v, o - 0.2), o + 0.2)
        assert float(loss[i]) == pytest.approx(0.5 * max((v - ret) ** 2, (vc - ret) ** 2))
        assert bool(clipped[i]) == ((vc - ret) ** 2 > (v - ret) ** 2)


def test_ppo_advantages_are_gae_over_kl_penalised_rewards_then_whitened():
    rl = RLSection(group_size=2, loss="dapo", kl_beta=0.05, max_new_tokens=6)
    objective = PPOObjective(MethodSection(stage="ppo", rl=rl, ppo={"gamma": 0.95, "lam": 0.9}))
    batch, positions = _hand_batch()
    batch.extras["old_values"] = torch.randn(batch.targets.shape)
    scores = torch.tensor([1.0, 0.0, 0.5, 2.0])
    keep, _ = objective.assign_advantages([batch], [scores], lambda t: t)  # one rank: the sum is the value
    assert keep == [True] * 4
    raw = []
    for r, cols in enumerate(positions):
        old, ref = batch.extras["old_logps"][r, cols].tolist(), batch.extras["ref_logps"][r, cols].tolist()
        rewards = [-0.05 * (o - f) for o, f in zip(old, ref, strict=True)]
        rewards[-1] += float(scores[r])
        raw.append(_reference_gae(rewards, batch.extras["old_values"][r, cols].tolist(), 0.95, 0.9))
    flat = [a for row in raw for a in row]
    mean, std = statistics.mean(flat), statistics.stdev(flat)
    for r, cols in enumerate(positions):
        got = batch.extras["advantages"][r, cols].tolist()
        assert got == pytest.approx([(a - mean) / (std + 1e-8) for a in raw[r]], rel=1e-4, abs=1e-5)


def test_the_ppo_loss_is_the_surrogate_plus_the_weighted_value_loss():
    rl = RLSection(group_size=2, loss="dapo", clip=(0.2, 0.2), max_new_tokens=6)
    objective = PPOObjective(MethodSection(stage="ppo", rl=rl, ppo={"vf_coef": 0.3, "value_clip": 0.1}))
    batch, positions = _hand_batch()
    torch.manual_seed(4)
    for key in ("advantages", "returns", "old_values"):
        batch.extras[key] = torch.randn(batch.targets.shape)
    n = int((batch.targets != IGNORE).sum())
    logps, values = -torch.rand(n), torch.randn(n)
    sums = objective.loss((logps, values), batch)
    policy, value, at = 0.0, 0.0, 0
    for r, cols in enumerate(positions):
        for col in cols:
            old, adv = float(batch.extras["old_logps"][r, col]), float(batch.extras["advantages"][r, col])
            policy += _reference_token_loss(float(logps[at]), old, adv, 0.2, 0.2, 0.0, None)[0]
            v, o, ret = (
                float(values[at]),
                float(batch.extras["old_values"][r, col]),
                float(batch.extras["returns"][r, col]),
            )
            vc = min(max(v, o - 0.1), o + 0.1)
            value += 0.5 * max((v - ret) ** 2, (vc - ret) ** 2)
            at += 1
    assert float(sums["loss"]) / n == pytest.approx((policy + 0.3 * value) / n, rel=1e-5)  # TRL: token means
    assert float(sums["value_loss"]) / n == pytest.approx(value / n, rel=1e-5)


def test_a_kl_term_needs_a_live_reference():
    from shardforge.errors import ConfigError
    from shardforge.models import build_preset

    method = MethodSection(stage="grpo", rl=RLSection(kl_beta=0.1), pref={"ref": "precompute"})
    with pytest.raises(ConfigError, match=r"ref=precompute: stage grpo with kl_beta > 0 scores new rollouts"):
        GRPOObjective(method).bind(_context(build_preset("tiny-llama", vocab_size=64)))
    without = GRPOObjective(MethodSection(stage="grpo"))
    message = without.bind(_context(build_preset("tiny-llama", vocab_size=64)))
    assert "kl_beta is 0" in message and without.reference_model is None


def _context(model):
    """What the run hands `bind`: one process, no layout."""
    from shardforge.objectives.base import BindContext

    return BindContext(model, None, None, False, lambda t: t, lambda m: m)


@pytest.mark.parametrize(
    "how, filter_groups, preset",
    [
        ("grpo", False, "tiny-llama"),
        ("dapo", True, "tiny-llama"),
        ("dr_grpo", False, "tiny-llama"),
        ("grpo", True, "tiny-mistral"),  # a sliding window
        ("dapo", False, "tiny-qwen3-moe"),  # experts
    ],
)
def test_a_group_in_one_row_trains_as_its_completions_one_per_row(how, filter_groups, preset):
    """The rollout source puts each group in one row: its sequences packed whole, or its prompt once with
    the completions after it (`collate_groups`: a shared prefix, attended through the per-document
    layout). The advantages, the filtered groups' keep, the loss sums and the gradients equal those of one
    completion per row (fp32), for prompts of one token (no trunk) and longer, sequences longer than the
    sliding window (32), dense and mixture-of-experts layers (the layout alone: with its balancing, an MoE
    model's rollouts are packed whole, `rollout_packing`)."""
    rl = RLSection(group_size=3, loss=how, clip=(0.2, 0.28), max_new_tokens=6, filter_groups=filter_groups)
    objective = GRPOObjective(MethodSection(stage="grpo", rl=rl))
    gen = torch.Generator().manual_seed(7)
    examples, groups = [], []
    for prompt_length, lengths in ((4, (2, 5, 3)), (1, (6, 1, 4)), (30, (9, 3, 12))):
        prompt = tuple(torch.randint(3, 200, (prompt_length,), generator=gen).tolist())
        completions = [tuple(torch.randint(3, 200, (n,), generator=gen).tolist()) for n in lengths]
        groups.append((prompt, completions))
        for c in completions:
            examples.append(Example((*prompt, *c), (False,) * prompt_length + (True,) * len(c), "rollout"))
    scores = [torch.tensor([1.0, 0.0, 0.5, 2.0, 2.0, 2.0, -1.0, 0.0, 3.0], dtype=torch.float64)]  # 2nd flat
    batches = {
        "rows": collate(examples, [[i] for i in range(9)], pad_id=0),
        "packed": collate(examples, [[0, 1, 2], [3, 4, 5], [6, 7, 8]], pad_id=0),
        "shared": collate_groups(groups, pad_id=0),
    }
    # the prompt once, but its last token leading each completion
    assert batches["shared"].num_tokens == sum(len(p) - 1 + sum(1 + len(x) for x in c) for p, c in groups)
    results = {}
    for name, batch in batches.items():
        model = build_preset(preset, vocab_size=200, seed=3)
        keep, _ = objective.assign_advantages([batch], scores, lambda t: t)
        batch.extras["sampled_logps"] = torch.zeros(batch.targets.shape)
        sums = objective.loss(model(batch.input_ids, **objective.model_inputs(batch)), batch)
        sums["loss"].backward()
        grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
        results[name] = (keep, {k: float(v) for k, v in sums.items()}, grads)
    keep_rows, sums_rows, grads_rows = results["rows"]
    assert keep_rows == [True] * 3 + [not filter_groups] * 3 + [True] * 3
    assert any(bool(g.abs().max() > 1e-4) for g in grads_rows.values())  # the comparison means something
    for name in ("packed", "shared"):
        keep, sums, grads = results[name]
        assert keep == keep_rows
        assert sums == pytest.approx(sums_rows, rel=1e-5, abs=1e-6), name
        for param, grad in grads_rows.items():
            torch.testing.assert_close(grads[param], grad, rtol=1e-5, atol=1e-6, msg=f"{name}: {param}")


def test_how_rollouts_become_rows():
    """GRPO: the prompt once per group on our dense decoder, sequences packed whole under a pipeline (its
    chunks attend by masks), on a transformers family that packs by positions and on a mixture of experts
    (its balancing counts the tokens a forward runs), one per row on a family that cannot pack and on experts
    with a capacity (it drops choices by the forward's token count); PPO always one per row (GAE runs along
    rows)."""
    grpo, ppo = GRPOObjective(), PPOObjective(MethodSection(stage="ppo"))
    native = build_preset("tiny-llama", vocab_size=200, seed=0)
    experts = build_preset("tiny-qwen3-moe", vocab_size=200, seed=0)
    generic = SimpleNamespace(packs=True, shares_prefixes=False, modules=list)
    unpacked = SimpleNamespace(packs=False, shares_prefixes=False, modules=list)
    one, piped = SimpleNamespace(pp=1), SimpleNamespace(pp=2)
    dropless, capped = MoESection(), MoESection(capacity_factor=1.25)
    packed_groups = grpo.traits.packed_groups
    assert rollout_packing(packed_groups, native, one, dropless) == "shared"
    assert rollout_packing(packed_groups, native, one, capped) == "shared"  # no experts: no capacity
    assert rollout_packing(packed_groups, native, piped, dropless) == "packed"
    assert rollout_packing(packed_groups, generic, one, dropless) == "packed"
    assert rollout_packing(packed_groups, unpacked, one, dropless) == "rows"
    assert rollout_packing(packed_groups, experts, one, dropless) == "packed"
    assert rollout_packing(packed_groups, experts, one, capped) == "rows"
    assert rollout_packing(ppo.traits.packed_groups, native, one, dropless) == "rows"


def test_an_moe_groups_sequences_packed_whole_balance_as_one_per_row():
    """With its balancing loss on (the MoE presets' default), an expert model's group packed whole in one
    row (what `rollout_packing` picks for it) gives the gradients of one sequence per row: the loss counts
    the same tokens. A shared prompt would count its tokens once (hence not chosen for experts)."""
    rl = RLSection(group_size=4, loss="grpo", max_new_tokens=16)
    objective = GRPOObjective(MethodSection(stage="grpo", rl=rl))
    gen = torch.Generator().manual_seed(5)
    examples = []
    for prompt_length, lengths in ((30, (3, 4, 2, 5)), (20, (2, 6, 1, 3))):
        prompt = torch.randint(3, 200, (prompt_length,), generator=gen).tolist()
        for n in lengths:
            ids = (*prompt, *torch.randint(3, 200, (n,), generator=gen).tolist())
            examples.append(Example(ids, (False,) * prompt_length + (True,) * n, "rollout"))
    scores = [torch.tensor([1.0, 0.0, 3.0, 2.0, 2.0, 1.0, 0.0, 5.0], dtype=torch.float64)]
    grads = []
    for layout in ([[i] for i in range(8)], [[0, 1, 2, 3], [4, 5, 6, 7]]):
        model = build_preset("tiny-qwen3-moe", vocab_size=200, seed=3).train()
        layers = moe_layers(model)
        batch = collate(examples, layout, pad_id=0)
        for layer in layers:
            layer.balance = Balance(layers=len(layers), aux_loss_coef=0.001)
            layer.loss_weight = 1.0 / batch.num_tokens  # as the loop weighs it: per token of the batch
        objective.assign_advantages([batch], scores, lambda t: t)
        batch.extras["sampled_logps"] = torch.zeros(batch.targets.shape)
        objective.loss(model(batch.input_ids, **objective.model_inputs(batch)), batch)["loss"].backward()
        grads.append({name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None})
    rows, packed = grads
    assert any("gate" in name for name in rows)  # the router is trained (by the balancing loss too)
    for name, grad in rows.items():
        torch.testing.assert_close(packed[name], grad, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("packing", ["shared", "packed", "rows"])
def test_the_attention_pairs_counted_for_mfu_are_those_the_layout_computes(packing):
    """Each real token attends its position + 1 keys (positions continue from a shared trunk and restart
    per packed sequence): counted over the collated micro-batch, they equal `attention_pairs`."""
    generator = torch.Generator().manual_seed(0)
    groups, lengths, completions = [], [], []
    for _ in range(3):  # 3 groups of 4, prompts of 1-9 tokens, completions of 0-6
        prompt = torch.randint(1, 50, (int(torch.randint(1, 10, (1,), generator=generator)),)).tolist()
        outs = [torch.randint(1, 50, (int(torch.randint(0, 7, (1,), generator=generator)),)).tolist()
                for _ in range(4)]  # fmt: skip
        groups.append((prompt, outs))
        lengths += [len(prompt) + len(o) for o in outs]
        completions += [len(o) for o in outs]
    if packing == "shared":
        batch = collate_groups(groups, pad_id=0, multiple=8)
    else:
        examples = [Example(tuple(p + o), (True,) * len(p + o), "t") for p, outs in groups for o in outs]
        layout = [list(range(g * 4, g * 4 + 4)) for g in range(3)] if packing == "packed" else None
        batch = collate(examples, layout or [[i] for i in range(12)], pad_id=0, multiple=8)
    if batch.doc_ids is None:  # one sequence per row: its first tokens are real
        real = torch.arange(batch.targets.shape[1])[None] < torch.tensor(lengths)[:, None]
    else:
        real = batch.doc_ids >= 0
    computed = int(((batch.position_ids + 1) * real).sum())
    assert computed == attention_pairs(lengths, completions, 4, packing)
