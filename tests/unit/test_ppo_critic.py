"""PPO with a separate critic model (`method.ppo.critic: FOLDER`, TRL's `value_model`): the values are the
critic's score head on its own body at the policy's scored positions, the value loss trains the critic only,
the run checkpoints and resumes it, exports it beside the policy as `final/critic/` (a transformers sequence
classifier giving the same per-token values) and `shardforge export` writes the same; layouts it cannot
follow and bad folders are refused by name; the planner counts its memory."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from shardforge.checkpoint.export import export_checkpoint
from shardforge.config import load_config
from shardforge.errors import CheckpointError, ConfigError
from shardforge.models import build_preset, load_model, save_model
from shardforge.models.common.config import DecoderConfig
from shardforge.models.head import PolicyValues, attach_critic, attach_value_head
from shardforge.models.llama.model import Decoder
from shardforge.objectives.rl import load_critic
from shardforge.planner.inventory import FP32_BYTES
from shardforge.planner.layout import layout_of
from shardforge.planner.memory import MemoryModel
from shardforge.planner.preflight import preflight
from shardforge.train.trainer import Trainer
from tests.conftest import TOKENIZER, tiny_config
from tests.dist._training import logged, stopped_and_resumed

VOCAB = len(AutoTokenizer.from_pretrained(TOKENIZER))


def critic_folder(root: Path, vocab: int = VOCAB, score_head: bool = True, heads: int = 4) -> Path:
    """A small decoder of its own shape (not the policy's), as an rm run exports it (`score_head`), or a
    causal LM that gets a fresh score head when loaded as a critic."""
    shape = DecoderConfig(vocab_size=vocab, hidden_size=8 * heads, intermediate_size=64, num_layers=2,
                          num_heads=heads, num_kv_heads=heads // 2 or 1, head_dim=8)  # fmt: skip
    model = Decoder(shape.with_score_head(1) if score_head else shape)
    model.init_weights(seed=7)
    return save_model(model, root / ("rm" if score_head else "lm"), AutoTokenizer.from_pretrained(TOKENIZER))


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> Path:
    from tests.dist.test_rl_layouts import addition_prompts  # (that module imports this one)

    return addition_prompts(tmp_path_factory.mktemp("ppo") / "prompts.jsonl")


def _cfg(tmp_path: Path, data: Path, critic: str, **sections) -> dict:
    rl = {"group_size": 4, "max_new_tokens": 8, "kl_beta": 0.05,
          "rewards": [{"name": "tests.dist.test_rl_layouts:digit_share"}]}  # fmt: skip
    base = {
        "data": {"max_length": 64},
        "train": {"steps": 3, "micro_batch": 2, "lr": 3e-3, "warmup": 0, "log_every": 1},
        "checkpoint": {"every": 2},
        "method": {"stage": "ppo", "rl": rl, "ppo": {"critic": critic, "vf_coef": 0.5}},
    }
    for key, value in sections.items():
        base[key] = {**base.get(key, {}), **value}
    return tiny_config(tmp_path, data, **base)


def test_values_come_from_the_critic_and_its_loss_trains_it_alone(tmp_path):
    policy = build_preset("tiny-llama", VOCAB, seed=1)
    critic = load_model(critic_folder(tmp_path), num_labels=1)
    attach_critic(policy, critic)
    assert policy.value_head is None
    ids = torch.randint(0, VOCAB, (3, 10), generator=torch.Generator().manual_seed(0))
    mask = torch.zeros(3, 10, dtype=torch.bool)
    mask[:, 4:] = True
    logps, values = policy(ids, output_mask=mask, head=PolicyValues(ids[mask]))
    expected = critic(ids, output_mask=mask).squeeze(-1)  # the critic alone, on the same tokens
    assert values.shape == logps.shape == (18,)
    torch.testing.assert_close(values, expected, rtol=0, atol=0)
    values.square().sum().backward()
    assert all(p.grad is None for name, p in policy.named_parameters() if not name.startswith("critic."))
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in critic.parameters())


@pytest.mark.parametrize("critic", [False, True], ids=["value-head", "critic-model"])
def test_a_value_loss_with_a_zero_gradient_still_gives_the_critic_zeros(tmp_path, critic):
    """Every value clipped (or vf_coef 0): the critic's gradient is zeros, not none, so that AdamW's decay and
    momentum run on it as they do on every other trained parameter."""
    policy = build_preset("tiny-llama", VOCAB, seed=1)
    if critic:
        attach_critic(policy, load_model(critic_folder(tmp_path), num_labels=1))
    else:
        attach_value_head(policy, seed=0)
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))
    mask = torch.zeros(2, 8, dtype=torch.bool)
    mask[:, 3:] = True
    logps, values = policy(ids, output_mask=mask, head=PolicyValues(ids[mask]))
    (logps.sum() + 0.0 * values.sum()).backward()
    trained = policy.critic if critic else policy.value_head
    assert all(p.grad is not None and not p.grad.any() for p in trained.parameters())


def test_a_causal_lm_folder_gets_a_fresh_score_head(tmp_path):
    folder = critic_folder(tmp_path, score_head=False)
    policy = build_preset("tiny-llama", VOCAB, seed=1)
    first, again = load_critic(folder, policy), load_critic(folder, policy)
    assert first.config.num_labels == 1 and first.lm_head.weight.shape == (1, 32)
    torch.testing.assert_close(first.lm_head.weight, again.lm_head.weight)  # seeded
    body = load_model(folder)
    torch.testing.assert_close(first.layers[0].attn.q_proj.weight, body.layers[0].attn.q_proj.weight)


def test_ppo_with_a_critic_model_trains_resumes_and_exports_it(tmp_path, prompts):
    folder = critic_folder(tmp_path)
    start = load_file(str(folder / "model.safetensors"))
    whole = Trainer(load_config(None, base=_cfg(tmp_path / "whole", prompts, str(folder))))
    result = whole.train()
    assert result.history[0]["value_loss"] > 0 and result.history[0]["grad_norm"] > 0

    # Stopped after its checkpoint at step 2 and resumed: the same losses as the run that was not stopped.
    stopped_and_resumed(_cfg(tmp_path / "stopped", prompts, str(folder)), 2)
    keys = ("loss", "value_loss", "grad_norm")
    again = logged(tmp_path / "stopped" / "run")
    for key in keys:
        assert [r[key] for r in again] == pytest.approx([r[key] for r in result.history], rel=1e-6, abs=1e-9)

    # final/ is the policy alone; final/critic/ is the trained critic, a transformers sequence classifier.
    final = result.final_model
    assert not [k for k in load_file(str(final / "model.safetensors")) if "critic" in k or "value" in k]
    trained = load_file(str(final / "critic" / "model.safetensors"))
    assert set(trained) == set(start)
    assert any(not torch.equal(trained[k], start[k]) for k in start)  # the critic learned
    live = whole.engine.inner.critic.eval()
    hf = AutoModelForSequenceClassification.from_pretrained(final / "critic").eval()
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = live(ids, output_mask=torch.ones(2, 12, dtype=torch.bool)).view(2, 12)
        theirs = hf.model(input_ids=ids).last_hidden_state @ hf.score.weight.T
    torch.testing.assert_close(ours, theirs.squeeze(-1), rtol=1e-5, atol=1e-5)

    # Resuming with a critic of another shape is refused by name, before any weight is read.
    other = critic_folder(tmp_path / "other", heads=2)
    cfg = _cfg(tmp_path / "whole", prompts, str(other), train={"steps": 4})
    with pytest.raises(
        CheckpointError, match=r"critic: .*hidden_size 32 -> 16.*resume with the critic it was"
    ):
        Trainer(load_config(None, base=cfg)).train()

    # `shardforge export` of the last checkpoint writes the same critic (and the same policy).
    _, out, what = export_checkpoint(tmp_path / "whole" / "run", tmp_path / "exported")
    assert what.endswith("and its critic (critic/)")
    exported = load_file(str(out / "critic" / "model.safetensors"))
    assert all(torch.equal(exported[k], trained[k]) for k in trained)


def _checked(cfg: dict, world: int = 1):
    config = load_config(None, base=cfg)
    shape = build_preset("tiny-llama", VOCAB).config
    return preflight(config, world, shape, measure=False)


def test_what_a_critic_model_cannot_follow_is_refused_by_name(tmp_path, prompts):
    folder = str(critic_folder(tmp_path))
    with pytest.raises(
        ConfigError, match=r"method.ppo.critic '.*nowhere' is not auto, head or a model folder"
    ):
        _checked(_cfg(tmp_path, prompts, str(tmp_path / "nowhere")))
    with pytest.raises(ConfigError, match=r"parallel.pp=2 with a separate critic model"):
        _checked(_cfg(tmp_path, prompts, folder, parallel={"pp": 2, "dp_shard": 1}), world=2)
    odd = str(critic_folder(tmp_path / "odd", heads=3))
    with pytest.raises(ConfigError, match=r"method.ppo.critic '.*odd/rm': parallel.tp=2 does not divide"):
        _checked(
            _cfg(tmp_path, prompts, odd, parallel={"tp": 2, "dp_shard": 1, "sequence_parallel": False}), 2
        )
    other = critic_folder(tmp_path / "other", vocab=VOCAB + 64)
    cfg = _cfg(tmp_path / "vocab", prompts, str(other))
    with pytest.raises(ConfigError, match=rf"has a vocabulary of {VOCAB + 64} tokens, the policy {VOCAB}"):
        Trainer(load_config(None, base=cfg)).train()


def test_the_planner_counts_the_critic_model(tmp_path, prompts):
    """One process, fp32, AdamW: the critic's weights, gradients and two moments (4 bytes each a parameter)
    are held beside the policy's, and its forward's activations beside the policy's."""
    folder = critic_folder(tmp_path)
    shape = build_preset("tiny-llama", VOCAB).config
    layout = layout_of(load_config(None, base=_cfg(tmp_path, prompts, "head")), 1)

    def estimate(critic: str):
        cfg = load_config(None, base=_cfg(tmp_path, prompts, critic))
        return MemoryModel(cfg, shape, _costs(shape)).estimate(layout, None, on_gpu=False)

    head, separate = estimate("head"), estimate(str(folder))
    params = sum(p.numel() for p in load_model(folder, num_labels=1).parameters())
    assert separate.states.params - head.states.params == params * FP32_BYTES
    assert separate.states.grads - head.states.grads == params * FP32_BYTES
    steps = len(list(load_model(folder, num_labels=1).parameters())) * FP32_BYTES  # AdamW's step counters
    assert separate.states.optimizer - head.states.optimizer == 2 * params * FP32_BYTES + steps
    assert separate.reference == head.reference  # the frozen reference copy is of the policy alone
    assert separate.activations > head.activations
    assert separate.device_bytes > head.device_bytes + 4 * params * FP32_BYTES


def _costs(shape):
    from shardforge.models.spec import spec_for

    return spec_for(shape.family).costs(shape)
