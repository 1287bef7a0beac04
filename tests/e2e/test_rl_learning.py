"""RL that learns, on this CPU in seconds: a tiny Llama is first taught single-digit addition by SFT (about
half of its greedy answers right), then GRPO (DAPO's loss, the exact-answer reward) on the same 100 prompts
raises the mean reward of its own samples and its greedy accuracy by clear margins; PPO with a value head and
a KL penalty against the SFT model raises the reward too, and so does PPO with a separate critic model.
Everything is seeded; the margins stated below are inside what the runs reach (measured: GRPO reward 0.52 ->
0.70, greedy accuracy 0.52 -> 0.94; PPO reward 0.56 -> 0.70, with a critic model 0.52 -> 0.68)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from shardforge.config import load_config
from shardforge.config.data_schema import DataSection
from shardforge.infer.engine import Engine
from shardforge.infer.sampling import SamplingParams
from shardforge.models import load_model
from shardforge.objectives import reading_for
from shardforge.objectives.rewards import answers_equal, final_answer
from shardforge.objectives.rollout import load_prompts
from shardforge.train.trainer import Trainer
from tests.conftest import TOKENIZER, tiny_config
from tests.dist._training import logged, stopped_and_resumed

pytestmark = pytest.mark.slow


def _config(out: Path, **sections) -> dict:
    base = {
        "output_dir": str(out),
        "model": {"preset": "tiny-llama", "tokenizer": str(TOKENIZER)},
        "data": {"train": [{"path": str(out.parent / "add.jsonl"), "format": "alpaca"}], "max_length": 64},
        "train": {"micro_batch": 16, "schedule": "constant", "warmup": 0, "seed": 0, "log_every": 1},
        "log": {"tensorboard": False, "plot": False},
    }
    for key, value in sections.items():
        base[key] = {**base.get(key, {}), **value}
    return base


def _greedy_accuracy(folder: Path, data: Path) -> float:
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    prompts, _ = load_prompts(
        DataSection(train=[{"path": str(data), "format": "alpaca"}]), tokenizer, 60, reading_for("grpo")
    )
    done = Engine(load_model(folder), tokenizer).generate(
        [p.ids for p in prompts], SamplingParams(max_tokens=6, temperature=0)
    )
    texts = [tokenizer.decode(c[0].tokens, skip_special_tokens=True) for c in done]
    return sum(answers_equal(final_answer(t), p.answer) for t, p in zip(texts, prompts, strict=True)) / len(
        texts
    )


@pytest.fixture(scope="module")
def sft_model(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("rl")
    data = root / "add.jsonl"
    records = [{"instruction": "Add the two numbers.", "input": f"{a} + {b}", "output": str(a + b)}
               for a in range(10) for b in range(10)]  # fmt: skip
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    cfg = _config(root / "sft", method={"stage": "sft"}, train={"steps": 300, "lr": 3e-3, "log_every": 50},
                  data={"packing": False})  # fmt: skip
    Trainer(load_config(None, base=cfg)).train()
    return root / "sft" / "final"


def test_grpo_raises_the_reward_after_sft(sft_model):
    data = sft_model.parents[1] / "add.jsonl"
    before = _greedy_accuracy(sft_model, data)
    cfg = _config(
        sft_model.parents[1] / "grpo",
        model={"preset": None, "path": str(sft_model)},
        method={"stage": "grpo", "rl": {"group_size": 8, "max_new_tokens": 6, "loss": "dapo"}},
        train={"steps": 100, "micro_batch": 8, "grad_accum": 2, "lr": 5e-4},
    )
    result = Trainer(load_config(None, base=cfg)).train()
    rewards = [r["reward_mean"] for r in result.history]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-10:]) / 10
    after = _greedy_accuracy(result.final_model, data)
    print(f"GRPO: mean reward {first:.3f} -> {last:.3f}; greedy accuracy {before:.2f} -> {after:.2f}")
    assert 0.4 < before < 0.8  # the SFT model is partly right: there is something to learn
    assert last >= first + 0.15
    assert after >= before + 0.15
    record = result.history[-1]
    assert abs(record["logprob_delta"]) < 1e-4  # the engine's sampling log-probs are the training forward's
    assert record["time/rollout_s"] > 0 and record["rollout_tokens_per_s"] > 0


@pytest.mark.parametrize("critic", ["head", "model"])
def test_ppo_with_kl_raises_the_reward(sft_model, critic):
    """With a value head on the policy, or a separate critic model: the SFT model's body with a fresh
    score head (TRL initializes its value model from a trained model, too)."""
    cfg = _config(
        sft_model.parents[1] / f"ppo-{critic}",
        model={"preset": None, "path": str(sft_model)},
        method={"stage": "ppo", "rl": {"group_size": 4, "max_new_tokens": 6, "kl_beta": 0.02},
                "ppo": {"vf_coef": 0.1, "critic": "head" if critic == "head" else str(sft_model)}},
        train={"steps": 100, "micro_batch": 8, "grad_accum": 2, "lr": 5e-4},
    )  # fmt: skip
    result = Trainer(load_config(None, base=cfg)).train()
    rewards = [r["reward_mean"] for r in result.history]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-10:]) / 10
    values = [r["value_loss"] for r in result.history]
    print(f"PPO ({critic}): reward {first:.3f} -> {last:.3f}; value loss {values[0]:.3f} -> {values[-1]:.3f}")
    assert last >= first + 0.1
    assert sum(values[-10:]) < sum(values[:10])  # the critic learns the returns
    assert "value_head.weight" not in load_model(result.final_model).state_dict()
    assert (result.final_model / "critic").is_dir() == (critic == "model")


@pytest.mark.parametrize("example", ["grpo_math.yaml", "ppo.yaml"])
def test_the_example_configs_run_from_the_cli(sft_model, tmp_path, example):
    """The bundled examples as `shardforge train` runs them, over the SFT model (not the demo's, which a
    clean machine has not trained yet): a few steps, each record with the rollout's figures."""
    run = tmp_path / "run"
    overrides = [f"model.path={sft_model}", f"output_dir={run}", "train.steps=2", "train.log_every=1",
                 "train.micro_batch=4", "checkpoint.every=2", "log.tensorboard=false"]  # fmt: skip
    repo = Path(__file__).resolve().parents[2]
    proc = subprocess.run(
        [sys.executable, "-m", "shardforge", "train", str(repo / "examples" / example), *overrides],
        capture_output=True, text=True, timeout=600, cwd=repo,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 2
    figures = ("reward_mean", "reward/math_answer", "kl", "entropy", "clip_fraction", "response_length_max",
               "truncated_fraction", "rollout_tokens_per_s", "time/rollout_s", "time/scoring_s",
               "time/training_s", "time/weight_sync_s")  # fmt: skip
    missing = [key for key in figures if key not in records[0]]  # the first step samples a rollout
    assert not missing, missing
    assert (run / "checkpoints" / "step-00000002").is_dir() and (run / "final" / "config.json").is_file()


def test_an_interrupted_grpo_run_resumes_with_the_same_losses(tmp_path):
    """Rollouts are seeded by the prompts' global positions and the source's position is checkpointed, so a
    run stopped after its checkpoint at step 2 and started again samples and trains exactly as one that was
    not stopped (the resumed process rebuilds the engine and its seeds from the saved position)."""
    records = [
        {"instruction": "Add.", "input": f"{a} + {a + 3}", "output": str(2 * a + 3)} for a in range(16)
    ]
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))

    def config(name: str) -> dict:
        rl = {"group_size": 4, "max_new_tokens": 8, "loss": "grpo",
              "rewards": [{"name": "tests.dist.test_rl_layouts:digit_share"}]}  # fmt: skip
        return tiny_config(
            tmp_path / name, data, data={"max_length": 64}, method={"stage": "grpo", "rl": rl},
            train={"steps": 4, "micro_batch": 2, "lr": 3e-3, "warmup": 0, "log_every": 1},
            checkpoint={"every": 2, "save_final": False},
        )  # fmt: skip

    whole = Trainer(load_config(None, base=config("whole"))).train()
    stopped_and_resumed(config("stopped"), 2)
    records = logged(tmp_path / "stopped" / "run")
    assert [r["loss"] for r in records] == pytest.approx(
        [r["loss"] for r in whole.history], rel=1e-6, abs=1e-9
    )
    # A rollout trained once has a loss near 0 (ratio 1, a cancelling sum): the gradients tell steps apart.
    norms = [r["grad_norm"] for r in records]
    assert norms == pytest.approx([r["grad_norm"] for r in whole.history], rel=1e-6)
    assert min(norms) > 0


def test_grpo_with_a_reward_model_folder(sft_model, tmp_path):
    """`rewards: [{model: FOLDER}]`: a reward model (here a fresh score head on a tiny decoder, as stage rm
    exports it) scores every completion inside the run; its mean is logged under its folder's name."""
    from shardforge.models import save_model
    from shardforge.models.common.config import DecoderConfig
    from shardforge.models.llama.model import Decoder

    shape = {"vocab_size": 1024, "hidden_size": 64, "intermediate_size": 128, "num_layers": 2, "num_heads": 4,
             "num_kv_heads": 2, "head_dim": 16}  # fmt: skip
    rm = Decoder(DecoderConfig(**shape).with_score_head(1))
    rm.init_weights(seed=5)
    folder = save_model(rm, tmp_path / "rm", AutoTokenizer.from_pretrained(TOKENIZER))
    cfg = _config(
        sft_model.parents[1] / "grpo-rm",
        model={"preset": None, "path": str(sft_model)},
        method={
            "stage": "grpo",
            "rl": {"group_size": 4, "max_new_tokens": 6, "rewards": [{"model": str(folder)}]},
        },
        train={"steps": 2, "micro_batch": 2, "lr": 1e-4},
    )
    result = Trainer(load_config(None, base=cfg)).train()
    record = result.history[0]
    assert record["reward/rm:rm"] == pytest.approx(record["reward_mean"]) and record["reward_std"] > 0
    assert record["grad_norm"] > 0  # the scores differ within groups: there is a gradient
