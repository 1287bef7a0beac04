"""Each preference loss against the published formula, written here independently (scalar math per pair, no
call into shardforge), on hand-made log-probs: the values, and the gradients by central differences of the
independent formula against autograd through ours."""

from __future__ import annotations

import math

import pytest
import torch

from shardforge.objectives.preference_losses import (
    PAIR_LOSSES,
    Pairs,
    kto_kl,
    kto_loss,
    pair_loss,
    reward_pair_loss,
)

BETA, EPS, GAMMA = 0.3, 0.1, 0.4
# per pair: policy chosen, rejected (summed log-probs); reference chosen, rejected; their lengths
PAIRS = [
    (-12.0, -15.5, -13.0, -14.0, 6, 9),
    (-30.2, -22.1, -29.0, -25.3, 14, 10),
    (-4.4, -9.9, -4.0, -8.5, 3, 7),
]


def log_sigmoid(x: float) -> float:
    return -math.log1p(math.exp(-x)) if x > 0 else x - math.log1p(math.exp(x))


def published(kind: str, pc, pr, rc, rr, lc, lr, ftx: float = 0.0) -> float:
    """One pair's loss from each paper's formula (and TRL's length normalization where it applies)."""
    h = (pc - rc) - (pr - rr)  # DPO's implicit reward margin
    if kind == "sigmoid":  # DPO (Rafailov et al.), conservative with label smoothing (Mitchell)
        loss = -(1 - EPS) * log_sigmoid(BETA * h) - EPS * log_sigmoid(-BETA * h)
    elif kind == "robust":  # Chowdhury et al.: unbiased under label flips with rate eps
        loss = ((1 - EPS) * -log_sigmoid(BETA * h) - EPS * -log_sigmoid(-BETA * h)) / (1 - 2 * EPS)
    elif kind == "hinge":  # SLiC's hinge on the margin
        loss = max(0.0, 1 - BETA * h)
    elif kind == "ipo":  # Azar et al. eq. 17, on per-token log-ratios
        loss = ((pc - rc) / lc - (pr - rr) / lr - 1 / (2 * BETA)) ** 2
    elif kind == "simpo":  # Meng et al.: length-normalized reward with a target margin gamma
        z = BETA * pc / lc - BETA * pr / lr - GAMMA
        loss = -(1 - EPS) * log_sigmoid(z) - EPS * log_sigmoid(-z)
    elif kind == "orpo":  # Hong et al.: NLL of the chosen + lambda * -log sigmoid(log odds ratio)
        p_c, p_r = math.exp(pc / lc), math.exp(pr / lr)
        log_odds_ratio = math.log((p_c / (1 - p_c)) / (p_r / (1 - p_r)))
        loss = -pc / lc - BETA * log_sigmoid(log_odds_ratio)
    else:
        raise AssertionError(kind)
    return loss + ftx * -pc / lc


def _ours(kind: str, values: torch.Tensor, ftx: float = 0.0):
    pc, pr, rc, rr, lc, lr = values.unbind(-1)
    policy = Pairs(pc, pr, lc, lr)
    reference = Pairs(rc, rr, lc, lr)
    eps = EPS if kind in ("sigmoid", "robust", "simpo") else 0.0
    return pair_loss(kind, policy, reference, BETA, label_smoothing=eps, simpo_gamma=GAMMA, ftx=ftx)


@pytest.mark.parametrize("ftx", [0.0, 0.5])
@pytest.mark.parametrize("kind", PAIR_LOSSES)
def test_pair_losses_and_gradients_equal_the_published_formulas(kind, ftx):
    values = torch.tensor(PAIRS, dtype=torch.float64, requires_grad=True)
    out = _ours(kind, values, ftx)
    expected = [published(kind, *p, ftx=ftx) for p in PAIRS]
    assert out.losses.tolist() == pytest.approx(expected, rel=1e-10)
    out.losses.sum().backward()
    for i, pair in enumerate(PAIRS):
        for j in range(4):  # the four log-probs (lengths are counts)
            step = 1e-6
            up, down = list(pair), list(pair)
            up[j] += step
            down[j] -= step
            numeric = (published(kind, *up, ftx=ftx) - published(kind, *down, ftx=ftx)) / (2 * step)
            assert values.grad[i, j].item() == pytest.approx(numeric, rel=1e-5, abs=1e-8), (kind, i, j)
    reference_free = kind in ("simpo", "orpo")
    for i, (pc, pr, rc, rr, lc, lr) in enumerate(PAIRS):
        want = (BETA * pc / lc, BETA * pr / lr) if reference_free else (BETA * (pc - rc), BETA * (pr - rr))
        got = (out.chosen_rewards[i].item(), out.rejected_rewards[i].item())
        assert got == pytest.approx(want, rel=1e-12)
    assert not out.chosen_rewards.requires_grad


def test_kto_loss_and_kl_equal_the_published_formula():
    policy = torch.tensor([-10.0, -7.5, -20.0, -3.0], dtype=torch.float64, requires_grad=True)
    reference = torch.tensor([-11.0, -7.0, -18.5, -3.5], dtype=torch.float64)
    desirable = torch.tensor([True, False, False, True])
    kl_policy = torch.tensor([-9.0, -12.0, -6.0], dtype=torch.float64, requires_grad=True)
    kl_reference = torch.tensor([-9.5, -12.2, -6.4], dtype=torch.float64)
    seen = []

    def two_ranks(total: torch.Tensor) -> None:  # another rank with one mismatched pair of log-ratio 0.9
        seen.append(total.clone())
        total += torch.tensor([0.9, 1.0], dtype=total.dtype)

    kl = kto_kl(kl_policy, kl_reference, two_ranks)
    z0 = max(0.0, (0.5 + 0.2 + 0.4 + 0.9) / 4)  # Ethayarajh et al.: z0, the clamped mean KL over the batch
    assert kl.item() == pytest.approx(z0, rel=1e-6) and not kl.requires_grad and len(seen) == 1
    wd, wu = 1.0, 1.5
    losses, rewards = kto_loss(policy, reference, desirable, kl, BETA, wd, wu)

    def value(r: float, good: bool) -> float:  # lambda_y - v(x, y)
        sigmoid = 1 / (1 + math.exp(-(BETA * (r - z0) if good else BETA * (z0 - r))))
        return (wd if good else wu) * (1 - sigmoid)

    ratios = (policy - reference).tolist()
    expected = [value(r, bool(g)) for r, g in zip(ratios, desirable, strict=True)]
    assert losses.tolist() == pytest.approx(expected, rel=1e-6)
    assert rewards.tolist() == pytest.approx([BETA * r for r in ratios], rel=1e-12)
    losses.sum().backward()
    for i, (r, g) in enumerate(zip(ratios, desirable.tolist(), strict=True)):
        numeric = (value(r + 1e-6, g) - value(r - 1e-6, g)) / 2e-6
        assert policy.grad[i].item() == pytest.approx(numeric, rel=1e-5)
    assert kl_policy.grad is None  # the reference point is detached
    negative = kto_kl(torch.tensor([-5.0]), torch.tensor([-4.0]))
    assert negative.item() == 0.0  # clamped at 0


def test_reward_pair_loss_is_bradley_terry():
    chosen = torch.tensor([1.5, -0.2, 3.0], dtype=torch.float64, requires_grad=True)
    rejected = torch.tensor([0.5, 0.4, -1.0], dtype=torch.float64)
    losses = reward_pair_loss(chosen, rejected)
    margin = (chosen - rejected).tolist()
    assert losses.tolist() == pytest.approx([math.log1p(math.exp(-m)) for m in margin], rel=1e-12)
    losses.sum().backward()
    assert chosen.grad.tolist() == pytest.approx([-1 / (1 + math.exp(m)) for m in margin], rel=1e-10)


def test_bad_settings_are_clear():
    p = Pairs(*torch.tensor([[-1.0], [-2.0], [3.0], [4.0]]))
    with pytest.raises(ValueError, match="needs a reference model"):
        pair_loss("sigmoid", p, None, 0.1)
    with pytest.raises(ValueError, match=r"label_smoothing in \[0, 0.5\)"):
        pair_loss("robust", p, p, 0.1, label_smoothing=0.5)
    with pytest.raises(ValueError, match="valid: sigmoid, ipo"):
        pair_loss("dpo", p, p, 0.1)
    assert pair_loss("orpo", p, None, 0.1).losses.shape == (1,)
