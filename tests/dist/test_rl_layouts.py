"""RL on two ranks equals one process (fp32): with the rollouts' sampling seeded by the prompts' global
positions, GRPO under ZeRO-3 (the FSDP2 units gathered once for the rollout, then resharded) and under
tensor parallel (both TP ranks running the engine in lockstep) and under a pipeline (each stage running its
layers of every engine step, the stream passed on, the last stage's logits broadcast) samples the same
completions, and gives the same losses, gradient norms and weights. Covered: full fine-tuning without a
reference, LoRA with the KL term (the reference is the adapters disabled), full fine-tuning with the KL
term against a frozen copy (sharded as the policy is), and PPO with its value head or with a separate
critic model (ZeRO-3, TP2, DDP). Three steps, the second
training on the first rollout again (epochs_per_rollout: 2, so ratios move off 1), the third sampling with
updated weights. One launch for all."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import tiny_config, write_jsonl
from tests.dist._harness import run_ranks
from tests.dist._training import assert_same, tiny_model_folder, train_runs
from tests.unit.test_ppo_critic import VOCAB, critic_folder


def digit_share(prompts, completions, answers):
    """A reward that differs between a random model's completions (so advantages are not all zero)."""
    return [sum(ch.isdigit() or ch in "aeiou" for ch in text) / max(1, len(text)) for text in completions]


def addition_prompts(path: Path) -> Path:
    """16 alpaca records asking for a sum, with the answer (the RL tests' prompts)."""
    records = [{"instruction": "Add the two numbers.", "input": f"{a} + {a + 3}", "output": str(2 * a + 3)}
               for a in range(16)]  # fmt: skip
    return write_jsonl(path, records)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return addition_prompts(tmp_path_factory.mktemp("rl") / "prompts.jsonl")


@pytest.fixture(scope="module")
def critic(tmp_path_factory):
    """PPO's separate critic model: a decoder of its own shape with a score head, as an rm run exports it."""
    return str(critic_folder(tmp_path_factory.mktemp("critic")))


@pytest.fixture(scope="module")
def four_layers(tmp_path_factory):
    """A 4-layer model: two stages per rank on a pipeline of 2 (interleaved or V-shaped)."""
    return tiny_model_folder(tmp_path_factory.mktemp("four"), VOCAB, seed=3, num_layers=4, num_kv_heads=2)


def _cfg(tmp_path, name, data, stage="grpo", finetuning="full", kl=0.0, mb=2, epochs=2, critic="auto",
         model=None, **parallel):  # fmt: skip
    rl = {
        "group_size": 4, "max_new_tokens": 8, "kl_beta": kl, "epochs_per_rollout": epochs, "temperature": 1.0,
        "rewards": [{"name": "tests.dist.test_rl_layouts:digit_share"}, {"name": "length", "weight": 0.5}],
    }  # fmt: skip
    return tiny_config(
        tmp_path / name,
        data,
        data={"max_length": 64},
        # eps 1e-6: Adam divides a rare token's embedding gradient (~1e-9, last bits set by the sum's order)
        # by its own root mean square; at eps 1e-8 that amplified a last-bit difference to 3.6e-4 in a weight.
        train={
            "steps": 3,
            "micro_batch": mb,
            "grad_accum": 2,
            "lr": 3e-3,
            "warmup": 0,
            "log_every": 1,
            "eps": 1e-6,
        },
        parallel=parallel,
        checkpoint={"save_final": False},
        method={"stage": stage, "finetuning": finetuning, "rl": rl, "ppo": {"critic": critic}},
        **({"model": model} if model else {}),
    )


CASES = {
    "grpo-full": {},
    "grpo-once": {"epochs": 1},
    "grpo-lora-kl": {"finetuning": "lora", "kl": 0.1},
    "grpo-full-kl": {"kl": 0.1},
    "ppo-full-kl": {"stage": "ppo", "kl": 0.05},
}


def test_rl_on_two_ranks_equals_one_process(tmp_path, data, critic, four_layers):
    cases = {
        **CASES,
        "ppo-critic": {"stage": "ppo", "kl": 0.05, "critic": critic},
        "grpo-4l-kl": {"kl": 0.1, "model": four_layers},
        "ppo-4l-kl": {"stage": "ppo", "kl": 0.05, "model": four_layers},
    }
    refs = {
        name: train_runs([_cfg(tmp_path, f"one-{name}", data, **case)])[0] for name, case in cases.items()
    }
    for ref in refs.values():
        assert ref["losses"][0] != 0 and ref["grad_norms"][0] > 0  # the rewards differ: there is a gradient
    assert any(k.startswith("critic.") for k in refs["ppo-critic"]["state"])  # compared with the policy's
    zero3, tp2 = {"zero_stage": 3}, {"dp_shard": 1, "tp": 2, "sequence_parallel": False}
    ddp = {"dp_shard": 1, "dp_replicate": 2, "zero_stage": 0}
    # Two stages per rank: interleaved (the last stage on the last rank) and V-shaped (on the first).
    interleaved = {
        "dp_shard": 1,
        "pp": 2,
        "pp_microbatches": 2,
        "pp_schedule": "interleaved_1f1b",
        "pp_virtual": 2,
    }
    v_shaped = {"dp_shard": 1, "pp": 2, "pp_microbatches": 2, "pp_schedule": "zbv", "pp_virtual": 2}
    layouts = [
        ("grpo-full", _cfg(tmp_path, "grpo-zero3", data, mb=1, **zero3)),
        ("grpo-full", _cfg(tmp_path, "grpo-tp2", data, **tp2)),
        ("grpo-lora-kl", _cfg(tmp_path, "lora-kl-zero3", data, finetuning="lora", kl=0.1, mb=1, **zero3)),
        ("grpo-lora-kl", _cfg(tmp_path, "lora-kl-tp2", data, finetuning="lora", kl=0.1, **tp2)),
        ("grpo-full-kl", _cfg(tmp_path, "full-kl-zero3", data, kl=0.1, mb=1, **zero3)),
        ("ppo-full-kl", _cfg(tmp_path, "ppo-zero3", data, stage="ppo", kl=0.05, mb=1, **zero3)),
        ("ppo-full-kl", _cfg(tmp_path, "ppo-tp2", data, stage="ppo", kl=0.05, **tp2)),
        # A separate critic model: FSDP2 units of its own inside the policy's root, its own TP plan, DDP.
        (
            "ppo-critic",
            _cfg(tmp_path, "critic-zero3", data, stage="ppo", kl=0.05, critic=critic, mb=1, **zero3),
        ),
        ("ppo-critic", _cfg(tmp_path, "critic-tp2", data, stage="ppo", kl=0.05, critic=critic, **tp2)),
        ("ppo-critic", _cfg(tmp_path, "critic-ddp", data, stage="ppo", kl=0.05, critic=critic, mb=1, **ddp)),
        (
            "ppo-full-kl",
            _cfg(tmp_path, "ppo-pp2", data, stage="ppo", kl=0.05, dp_shard=1, pp=2, pp_microbatches=2),
        ),
        ("grpo-once", _cfg(tmp_path, "grpo-pp2", data, epochs=1, dp_shard=1, pp=2, pp_microbatches=2)),
        ("grpo-4l-kl", _cfg(tmp_path, "kl-interleaved", data, kl=0.1, model=four_layers, **interleaved)),
        ("ppo-4l-kl", _cfg(tmp_path, "ppo-zbv", data, stage="ppo", kl=0.05, model=four_layers, **v_shaped)),
        # Under a pipeline the rollout policy's and the reference's log-probs go through the stages.
        ("grpo-full", _cfg(tmp_path, "grpo-epochs-pp2", data, dp_shard=1, pp=2, pp_microbatches=2)),
        ("grpo-full-kl", _cfg(tmp_path, "full-kl-pp2", data, kl=0.1, dp_shard=1, pp=2, pp_microbatches=2)),
        (
            "grpo-lora-kl",
            _cfg(
                tmp_path, "lora-kl-pp2", data, finetuning="lora", kl=0.1, dp_shard=1, pp=2, pp_microbatches=2
            ),
        ),
    ]
    runs = run_ranks(train_runs, 2, [cfg for _, cfg in layouts])[0]
    for (name, cfg), run in zip(layouts, runs, strict=True):
        # A rollout whose completions all have max_new_tokens has token-mean advantages of 0: its loss, at
        # ratio 1, is a cancelling sum (measured ~4e-9, last-bit differences of 2e-9): 1e-7 absolute. PPO
        # under a pipeline sums over the schedule's chunks of each micro-batch; its loss (policy and value
        # terms of ~3e-3 that nearly cancel) moved by up to 4.8e-7 after the first step, whose gradient norm
        # is equal to the last bit (later norms within 9e-6, weights within 5e-5): 1e-6 absolute there.
        piped_ppo = name.startswith("ppo") and cfg["parallel"].get("pp", 1) > 1
        assert_same(run, refs[name], rel=1e-5, atol=1e-4, loss_atol=1e-6 if piped_ppo else 1e-7)


def test_rl_under_pipeline_and_zero3_equals_one_process(tmp_path, data):
    """pp2 x dp_shard2 on 4 ranks, with the KL term against a frozen copy: the rollout gathers the stage
    modules' FSDP units (their roots hold the embedding and head), the copy is gathered whole for its pass
    through the stages. And pp2 x tp2: the four ranks of one model copy generate together, led by the first
    (it alone schedules and samples)."""
    ref = train_runs([_cfg(tmp_path, "one", data, kl=0.1, mb=4)])[0]
    cfg = _cfg(tmp_path, "pp2-zero3", data, kl=0.1, mb=2, dp_shard=2, zero_stage=3, pp=2, pp_microbatches=2)
    pp_tp = _cfg(tmp_path, "pp2-tp2", data, kl=0.1, mb=4, dp_shard=1, pp=2, tp=2, sequence_parallel=False,
                 pp_microbatches=2)  # fmt: skip
    runs = run_ranks(train_runs, 4, [cfg, pp_tp])[0]
    for run in runs:
        assert_same(run, ref, rel=1e-5, atol=1e-4, loss_atol=1e-7)
