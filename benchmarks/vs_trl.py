"""The same DPO job on TRL's DPOTrainer and on shardforge, side by side.

One invocation builds the job once (a model folder, preference pairs, a held-out set), then runs the two sides
alternately, each in a fresh process, `--repeats` times, and reports medians as JSON and a markdown table:

    python benchmarks/vs_trl.py --repeats 3
    python benchmarks/vs_trl.py --model /work/models/smollm2-135m --data dpo_en_demo.json --pairs 64

The default job is a random-init `llama-10m` saved as an HF folder with the bundled tokenizer, trained on the
bundled `examples/data/demo_pref.jsonl` (the right answer chosen, another question's answer rejected). With
`--model` and `--data` (a LLaMA-Factory sharegpt ranking file such as dpo_en_demo.json, or our alpaca pairs),
a real model and real pairs.

Both sides: the same model folder, pairs and chat template; LoRA on every linear of attention and MLP (rank 8,
alpha 16, no dropout) with the reference as the policy with its adapters disabled (TRL's default for a PEFT
model, ours); the sigmoid loss with beta 0.1; `--batch` pairs per optimizer step, `--steps` steps; AdamW with
the same hyper-parameters, cosine schedule with 5% warmup, clipping at 1.0, fp32, the same thread count.
Measured on each side: pairs/s after the first step, the whole process's wall time, its peak RSS, and the
reward accuracy its own log reports over the last steps; one evaluator (transformers + peft, the same tokens)
then scores both final adapters on the held-out pairs: reward accuracy and margin, beta times the policy's
minus the base model's log-ratio of chosen over rejected.
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
PAIRS = REPO / "examples" / "data" / "demo_pref.jsonl"
BETA, RANK, ALPHA, LR, MAX_LENGTH = 0.1, 8, 16, 1e-3, 256
SIDES = ("trl", "shardforge")


# ---- the job ---------------------------------------------------------------------------------------------
def read_pairs(path: Path) -> list[tuple[list[dict], str, str]]:
    """(prompt turns, chosen, rejected) of each pair, read by shardforge's own readers (alpaca or sharegpt
    ranking form), so both sides get the same conversations."""
    sys.path.insert(0, str(REPO))
    from shardforge.config.data_schema import DatasetSpec
    from shardforge.data.loader import read_dataset
    from shardforge.objectives import reading_for

    fmt = "sharegpt" if path.suffix == ".json" else "alpaca"
    records = read_dataset(DatasetSpec(path=str(path), format=fmt), reading_for("dpo"))
    return [(list(r.messages[:-1]), r.messages[-1]["content"], r.rejected) for r in records]


def build_job(folder: Path, args: argparse.Namespace) -> None:
    pairs = read_pairs(Path(args.data))
    if len(pairs) < args.pairs + args.eval_pairs:
        raise SystemExit(f"{args.data} has {len(pairs)} pairs; asked for {args.pairs} + {args.eval_pairs}")
    splits = {"train": pairs[: args.pairs], "eval": pairs[args.pairs :][: args.eval_pairs]}
    for name, rows in splits.items():
        with open(folder / f"{name}.jsonl", "w") as f:
            for prompt, chosen, rejected in rows:
                f.write(json.dumps({"messages": prompt, "chosen": chosen, "rejected": rejected}) + "\n")
    job_model(folder, args.model)


def _train_rows(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "train.jsonl").read_text().splitlines()]


def _warmup(args: argparse.Namespace) -> int:
    return max(1, round(0.05 * args.steps))


# ---- the two sides (each in its own process) -------------------------------------------------------------
def run_trl(folder: Path, out: Path, args: argparse.Namespace) -> dict:
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import DPOConfig, DPOTrainer

    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(folder / "model")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(folder / "model", dtype=torch.float32)
    data = Dataset.from_list(
        [
            {
                "prompt": r["messages"],
                "chosen": [{"role": "assistant", "content": r["chosen"]}],
                "rejected": [{"role": "assistant", "content": r["rejected"]}],
            }
            for r in _train_rows(folder)
        ]
    )
    steps: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, *_, **__):
            steps.append(time.perf_counter())

    config = DPOConfig(
        output_dir=str(out / "trl"),
        per_device_train_batch_size=args.batch,
        gradient_accumulation_steps=1,
        max_steps=args.steps,
        learning_rate=LR,
        lr_scheduler_type="cosine",
        warmup_steps=_warmup(args),
        adam_beta1=0.9,
        adam_beta2=0.95,
        weight_decay=0.0,
        max_grad_norm=1.0,
        beta=BETA,
        loss_type=["sigmoid"],
        max_length=MAX_LENGTH,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        bf16=False,
        dataloader_num_workers=0,
        seed=args.seed,
        optim="adamw_torch_fused",
    )
    lora = LoraConfig(
        r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM"
    )
    trainer = DPOTrainer(
        model=model, args=config, train_dataset=data, processing_class=tokenizer, peft_config=lora,
        callbacks=[Clock()],
    )  # fmt: skip
    trainer.train()
    trainer.save_model(str(out / "trl-final"))
    accuracies = [h["rewards/accuracies"] for h in trainer.state.log_history if "rewards/accuracies" in h]
    return {
        "pairs_per_s": (len(steps) - 1) * args.batch / (steps[-1] - steps[0]),
        "wall_s": time.perf_counter() - start,
        "train_accuracy": statistics.fmean(accuracies[-5:]),
        "final": str(out / "trl-final"),
    }


def run_shardforge(folder: Path, out: Path, args: argparse.Namespace) -> dict:
    sys.path.insert(0, str(REPO))
    start = time.perf_counter()
    from shardforge.config import load_config
    from shardforge.train.trainer import Trainer

    config = {
        "output_dir": str(out / "shardforge"),
        "model": {"path": str(folder / "model")},
        "data": {
            "train": [{"path": str(folder / "train.jsonl"), "format": "openai"}],
            "max_length": MAX_LENGTH,
        },
        "method": {
            "stage": "dpo",
            "finetuning": "lora",
            "lora": {"rank": RANK, "alpha": ALPHA, "dropout": 0.0, "targets": "all"},
            "pref": {"loss": "sigmoid", "beta": BETA},
        },
        "train": {
            "steps": args.steps,
            "micro_batch": args.batch,
            "lr": LR,
            "schedule": "cosine",
            "warmup": _warmup(args),
            "betas": [0.9, 0.95],
            "weight_decay": 0.0,
            "clip": 1.0,
            "precision": "fp32",
            "seed": args.seed,
            "log_every": 1,
        },
        "hardware": {"threads": args.threads},
        "log": {"tensorboard": False, "plot": False, "progress": False},
    }
    trainer = Trainer(load_config(None, base=config))
    result = trainer.train()
    records = [json.loads(line) for line in (out / "shardforge" / "metrics.jsonl").read_text().splitlines()]
    steady = sum(r["step_time_s"] for r in records[1:])
    return {
        "pairs_per_s": (len(records) - 1) * args.batch / steady,
        "wall_s": time.perf_counter() - start,
        "train_accuracy": statistics.fmean(r["rewards/accuracy"] for r in records[-5:]),
        "final": str(result.final_model),
    }


# ---- one evaluator for both ------------------------------------------------------------------------------
def held_out(folder: Path, adapter: str) -> dict:
    """Reward accuracy and mean margin on the held-out pairs: beta (log pi - log ref)(chosen) minus the same
    of rejected, with the base model as the reference, every sequence tokenized by one encoder."""
    sys.path.insert(0, str(REPO))
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from shardforge.data.templates import encode_pairs, resolve_template

    tokenizer = AutoTokenizer.from_pretrained(folder / "model")
    rows = [json.loads(line) for line in (folder / "eval.jsonl").read_text().splitlines()]
    template = resolve_template(tokenizer, "auto")
    conversations = [
        ([*r["messages"], {"role": "assistant", "content": r["chosen"]}], r["rejected"], "eval") for r in rows
    ]
    encoded = encode_pairs(tokenizer, template, conversations)

    def logps(model: torch.nn.Module) -> torch.Tensor:
        out = []
        with torch.no_grad():
            for pair in encoded:
                for ids, flags in pair:
                    ids = torch.as_tensor(ids[:MAX_LENGTH], dtype=torch.long)[None]
                    scored = torch.as_tensor(flags[1 : ids.shape[1]])
                    logits = model(input_ids=ids).logits[0, :-1].float()
                    picked = torch.log_softmax(logits, -1).gather(1, ids[0, 1:, None])[:, 0]
                    out.append(float(picked[scored].sum()))
        return torch.tensor(out).view(-1, 2)

    base = AutoModelForCausalLM.from_pretrained(folder / "model", dtype=torch.float32).eval()
    reference = logps(base)
    policy = logps(PeftModel.from_pretrained(base, adapter).eval())
    ratios = policy - reference
    margins = BETA * (ratios[:, 0] - ratios[:, 1])
    return {"eval_accuracy": float((margins > 0).float().mean()), "eval_margin": float(margins.mean())}


# ---- the parent ------------------------------------------------------------------------------------------
def _forward(args: argparse.Namespace) -> list[str]:
    keys = ("steps", "batch", "threads", "seed")
    return [arg for key in keys for arg in (f"--{key}", str(getattr(args, key)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="an HF model folder (default: a random-init llama-10m)")
    parser.add_argument("--data", default=str(PAIRS), help="pairs: our alpaca jsonl or a LF sharegpt .json")
    parser.add_argument("--pairs", type=int, default=320)
    parser.add_argument("--eval-pairs", type=int, default=64)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    add_side_arguments(parser, SIDES)
    args = parser.parse_args()
    if run_child(args, {"trl": run_trl, "shardforge": run_shardforge}):
        return
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        build_job(folder, args)
        result = report(args, alternate(__file__, folder, args, _forward, SIDES, held_out))
        medians = result["median"]
        result["ratio_pairs_per_s"] = medians["shardforge"]["pairs_per_s"] / medians["trl"]["pairs_per_s"]
        if args.results:
            Path(args.results).write_text(json.dumps(result, indent=2))
        print_table(
            medians,
            ("pairs_per_s", "wall_s", "peak_rss_mib", "train_accuracy", "eval_accuracy", "eval_margin"),
        )
        print(f"shardforge / TRL pairs/s: {result['ratio_pairs_per_s']:.2f}x")


if __name__ == "__main__":
    main()
