"""The same GRPO job on TRL's GRPOTrainer (rollouts by transformers' generate) and on shardforge (rollouts by
its paged, continuously batched engine on the training weights), side by side.

One invocation builds the job once (a model folder and prompts), then runs the two sides alternately, each in
a fresh process, `--repeats` times, and reports medians as JSON and a markdown table:

    python benchmarks/vs_trl_grpo.py --repeats 2
    python benchmarks/vs_trl_grpo.py --model runs/demo/final      # the README demo's SFT model

The default model is a random-init `llama-10m` saved as an HF folder with the bundled tokenizer (its
completions run to max_new_tokens on both sides: the same work); the prompts are the bundled
`examples/data/demo_math.jsonl` arithmetic questions with their answers.

Both sides: the same model folder, prompts, chat template and reward (exact answer, shardforge's
`math_answer` on both); full fine-tuning, `--prompts-per-step` prompts x `--group` completions per step
(one forward/backward batch), at most `--max-new` new tokens, temperature 1, top-p 1, no top-k; DAPO's
loss and clip (0.2, 0.28), no KL term (beta 0), group-scaled rewards; AdamW with the same
hyper-parameters, constant rate, clipping at 1.0, fp32, the same thread count. Measured on each side:
rollout tokens/s (completion tokens over the time spent generating), step time after the first step, the
process's wall time and peak RSS, and the mean reward of the last steps.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from _sides import add_side_arguments, alternate, job_model, print_table, report, run_child

REPO = Path(__file__).resolve().parents[1]
PROMPTS = REPO / "examples" / "data" / "demo_math.jsonl"
LR, CLIP = 1e-5, (0.2, 0.28)
SIDES = ("trl", "shardforge")


def build_job(folder: Path, args: argparse.Namespace) -> None:
    rows = [json.loads(line) for line in PROMPTS.read_text().splitlines()][: args.prompts]
    with open(folder / "prompts.jsonl", "w") as f:
        for r in rows:
            turns = [{"role": "user", "content": f"{r['instruction']}\n{r['input']}"}]
            f.write(json.dumps({"messages": turns, "answer": r["answer"]}) + "\n")
    job_model(folder, args.model)


def _rows(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "prompts.jsonl").read_text().splitlines()]


# ---- the two sides (each in its own process) -------------------------------------------------------------
def run_trl(folder: Path, out: Path, args: argparse.Namespace) -> dict:
    sys.path.insert(0, str(REPO))
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from shardforge.objectives.rewards import Completions, math_answer

    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(folder / "model")
    model = AutoModelForCausalLM.from_pretrained(folder / "model", dtype=torch.float32)
    data = Dataset.from_list([{"prompt": r["messages"], "answer": r["answer"]} for r in _rows(folder)])

    def exact(prompts, completions, answer, **_):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return math_answer(Completions(list(map(str, prompts)), texts, [0] * len(texts), list(answer), []))

    steps: list[float] = []
    rollout = {"s": 0.0, "tokens": 0}

    class Clock(TrainerCallback):
        def on_step_end(self, *_, **__):
            steps.append(time.perf_counter())

    config = GRPOConfig(
        output_dir=str(out / "trl"),
        per_device_train_batch_size=args.prompts_per_step * args.group,
        gradient_accumulation_steps=1,
        num_generations=args.group,
        max_completion_length=args.max_new,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        loss_type="dapo",
        epsilon=CLIP[0],
        epsilon_high=CLIP[1],
        beta=0.0,
        scale_rewards="group",
        max_steps=args.steps,
        learning_rate=LR,
        lr_scheduler_type="constant",
        warmup_steps=0,
        adam_beta1=0.9,
        adam_beta2=0.95,
        weight_decay=0.0,
        max_grad_norm=1.0,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        bf16=False,
        dataloader_num_workers=0,
        seed=args.seed,
    )
    trainer = GRPOTrainer(
        model=model, reward_funcs=exact, args=config, train_dataset=data, processing_class=tokenizer,
        callbacks=[Clock()],
    )  # fmt: skip
    generate = trainer._generate_single_turn

    def timed(*a, **k):
        began = time.perf_counter()
        result = generate(*a, **k)
        rollout["s"] += time.perf_counter() - began
        rollout["tokens"] += sum(len(c) for c in result[0])
        return result

    trainer._generate_single_turn = timed
    trainer.train()
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    return {
        "rollout_tokens_per_s": rollout["tokens"] / rollout["s"],
        "step_s": (steps[-1] - steps[0]) / (len(steps) - 1),
        "wall_s": time.perf_counter() - start,
        "reward_last": statistics.fmean(rewards[-3:]),
    }


def run_shardforge(folder: Path, out: Path, args: argparse.Namespace) -> dict:
    sys.path.insert(0, str(REPO))
    start = time.perf_counter()
    from shardforge.config import load_config
    from shardforge.train.trainer import Trainer

    config = {
        "output_dir": str(out / "shardforge"),
        "model": {"path": str(folder / "model")},
        "data": {"train": [{"path": str(folder / "prompts.jsonl"), "format": "openai"}], "max_length": 512},
        "method": {
            "stage": "grpo",
            "rl": {
                "group_size": args.group,
                "max_new_tokens": args.max_new,
                "temperature": 1.0,
                "top_p": 1.0,
                "loss": "dapo",
                "clip": list(CLIP),
                "kl_beta": 0.0,
                "scale_rewards": "group",
                "rewards": [{"name": "math_answer"}],
            },
        },
        "train": {
            "steps": args.steps,
            "micro_batch": args.prompts_per_step,
            "lr": LR,
            "schedule": "constant",
            "warmup": 0,
            "betas": [0.9, 0.95],
            "weight_decay": 0.0,
            "clip": 1.0,
            "precision": "fp32",
            "seed": args.seed,
            "log_every": 1,
        },
        "checkpoint": {"save_final": False},
        "hardware": {"threads": args.threads},
        "log": {"tensorboard": False, "plot": False, "progress": False},
    }
    Trainer(load_config(None, base=config)).train()
    records = [json.loads(line) for line in (out / "shardforge" / "metrics.jsonl").read_text().splitlines()]
    tokens = sum(r["response_length_mean"] * args.prompts_per_step * args.group for r in records)
    return {
        "rollout_tokens_per_s": tokens / sum(r["time/rollout_s"] for r in records),
        "step_s": statistics.fmean(r["step_time_s"] for r in records[1:]),
        "wall_s": time.perf_counter() - start,
        "reward_last": statistics.fmean(r["reward_mean"] for r in records[-3:]),
        "weight_sync_s": statistics.fmean(r["time/weight_sync_s"] for r in records),
        "logprob_delta": max(abs(r["logprob_delta"]) for r in records),
    }


# ---- the parent ------------------------------------------------------------------------------------------
def _forward(args: argparse.Namespace) -> list[str]:
    keys = ("steps", "prompts_per_step", "group", "max_new", "threads", "seed")
    return [arg for key in keys for arg in (f"--{key.replace('_', '-')}", str(getattr(args, key)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="an HF model folder (default: a random-init llama-10m)")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--prompts-per-step", type=int, default=4)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--max-new", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    add_side_arguments(parser, SIDES)
    args = parser.parse_args()
    if run_child(args, {"trl": run_trl, "shardforge": run_shardforge}):
        return
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        build_job(folder, args)
        result = report(args, alternate(__file__, folder, args, _forward, SIDES))
        sf, trl = result["median"]["shardforge"], result["median"]["trl"]
        result["ratio_rollout_tokens_per_s"] = sf["rollout_tokens_per_s"] / trl["rollout_tokens_per_s"]
        result["ratio_step_speed"] = trl["step_s"] / sf["step_s"]
        if args.results:
            Path(args.results).write_text(json.dumps(result, indent=2))
        print_table(
            result["median"], ("rollout_tokens_per_s", "step_s", "wall_s", "peak_rss_mib", "reward_last")
        )
        print(
            f"shardforge / TRL: rollouts {result['ratio_rollout_tokens_per_s']:.2f}x faster, "
            f"whole steps {result['ratio_step_speed']:.2f}x faster"
        )


if __name__ == "__main__":
    main()
