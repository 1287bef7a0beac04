"""The same SFT job on Hugging Face Trainer (as a LLaMA-Factory user runs it) and on shardforge, side by side.

One invocation builds the job once (a random-init Llama-family model saved as an HF folder, the bundled
tokenizer, alpaca-style data with a realistic length spread, a held-out set), then runs the two sides
alternately, each in a fresh process, several times (repetition r uses seed r on both sides), and reports
medians as JSON and a markdown table:

    python benchmarks/vs_hf_trainer.py --repeats 3
    python benchmarks/vs_hf_trainer.py --repeats 3 --method lora     # transformers + peft vs our LoRA
    python benchmarks/vs_hf_trainer.py --real MODEL_FOLDER --data alpaca_en_demo.json --records 64

`--real` runs a real pretrained model (an HF folder with its tokenizer and chat template) on the first
--records records of an alpaca-format file, the next --eval-records held out: benchmarks/README.md says how to
get SmolLM2-135M-Instruct and LLaMA-Factory's alpaca_en_demo.json. Besides tokens/s, each side's whole
process is timed (start-up, loading, training and saving, as a user waits for it), and shardforge's MFU is
its own steady-state figure (the cost model's FLOPs over the measured peak).

Both sides: the same model folder and tokens (same chat template, response-only labels), one epoch over the
same records, about the same samples per optimizer step, AdamW (fused kernel on both) with the same
hyper-parameters, cosine schedule to 0 with 5% warmup, clipping 1.0, fp32, the same number of threads.
The difference under test: HF pads each batch to its longest sample (LLaMA-Factory's SFT default, no packing);
shardforge runs its defaults (packing with per-document attention, LM head on target positions only).
Throughput is timed after the first optimizer step; the held-out loss of both final models comes from one
evaluator (transformers forward, mean over response tokens).
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TOKENIZER = REPO / "examples" / "data" / "tokenizer"  # the toy job's
_WORD_TEXT = """
time people year way day man thing woman life child world school state family student group country
problem hand part place case week company system program question work government number night point
home water room mother area money story fact month lot right study book eye job word business issue
side kind head house service friend father power hour game line end member law car city community
name president team minute idea kid body information back parent face others level office door
health person art war history party result change morning reason research girl guy moment air
teacher force education
"""
WORDS = _WORD_TEXT.split()


# ---- the job ---------------------------------------------------------------------------------------------
def make_records(n: int, seed: int) -> list[dict]:
    """Alpaca-style records whose lengths spread like real instruction data: mostly short, a long tail."""
    rng = random.Random(seed)
    records = []
    for _ in range(n):
        kind = rng.random()
        if kind < 0.5:  # short answers
            a, b = rng.randint(1, 999), rng.randint(1, 999)
            records.append(
                {"instruction": "Add the two numbers.", "input": f"{a} + {b}", "output": f"{a + b}"}
            )
        elif kind < 0.85:  # a sentence or a few
            words = rng.sample(WORDS, rng.randint(3, 12))
            records.append(
                {
                    "instruction": "Sort these words alphabetically and explain.",
                    "input": " ".join(words),
                    "output": "The sorted words are: " + ", ".join(sorted(words)) + ".",
                }
            )
        else:  # long-form answers
            topic = rng.choice(WORDS)
            sentences = [
                f"The {rng.choice(WORDS)} of the {topic} is about {rng.choice(WORDS)} and "
                f"{rng.choice(WORDS)}."
                for _ in range(rng.randint(6, 30))
            ]
            records.append(
                {
                    "instruction": f"Write a short essay about the {topic}.",
                    "input": "",
                    "output": " ".join(sentences),
                }
            )
    return records


def build_job(folder: Path, args: argparse.Namespace) -> dict:
    import torch

    sys.path.insert(0, str(REPO))
    from transformers import AutoTokenizer

    from shardforge.data.files import iter_raw
    from shardforge.models import build_preset, save_model

    if args.real:  # a real model and records: the first --records train, the next --eval-records are held out
        (folder / "model").symlink_to(Path(args.real).resolve())
        records = [obj for _, obj in iter_raw(Path(args.data))]  # the records as they are written
        if len(records) < args.records + args.eval_records:
            raise SystemExit(f"{args.data} has {len(records)} records; asked for {args.records} + eval")
        splits = {"train": records[: args.records], "eval": records[args.records :][: args.eval_records]}
        for name, rows in splits.items():
            with open(folder / f"{name}.jsonl", "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in rows)
        return _shapes(folder, args)
    for name, n, seed in (("train", args.records, 0), ("eval", args.eval_records, 1)):
        with open(folder / f"{name}.jsonl", "w") as f:
            for r in make_records(n, seed):
                f.write(json.dumps(r) + "\n")
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    torch.manual_seed(0)
    save_model(
        build_preset(args.preset, vocab_size=len(tokenizer), seed=0), folder / "model", tokenizer=tokenizer
    )
    return _shapes(folder, args)


def _shapes(folder: Path, args: argparse.Namespace) -> dict:
    """shardforge's rows: as long as the longest record (512 at least), and about as many documents per
    optimizer step as HF's batch (rows x max_length ~ batch x mean length). Worked out here, once, so that
    neither side's process pays for the other's tokenization."""
    lengths = [len(ids) for ids, _ in encode(folder, "train")]
    max_length = max(512, max(lengths))
    job = {
        "max_length": max_length,
        "micro_batch": max(1, round(args.batch * statistics.mean(lengths) / max_length)),
    }
    (folder / "job.json").write_text(json.dumps(job))
    return job


def encode(folder: Path, split: str) -> list[tuple[list[int], list[int]]]:
    """Token ids and labels (-100 outside responses) exactly as shardforge's sft stage makes them."""
    from transformers import AutoTokenizer

    from shardforge.config.data_schema import DataSection, DatasetSpec
    from shardforge.data.loader import read_dataset
    from shardforge.objectives import build_objective, reading_for

    tokenizer = AutoTokenizer.from_pretrained(folder / "model")
    data = DataSection(train=[{"path": str(folder / f"{split}.jsonl"), "format": "alpaca"}], max_length=4096)
    encoder = build_objective("sft").encoder(tokenizer, data)
    out = []
    for record in read_dataset(
        DatasetSpec(path=str(folder / f"{split}.jsonl"), format="alpaca"), reading_for("sft")
    ):
        [(ids, trained)] = encoder(record)
        ids, trained = ids.tolist(), trained.tolist()
        out.append((ids, [t if m else -100 for t, m in zip(ids, trained, strict=True)]))
    return out


# ---- side A: transformers Trainer ------------------------------------------------------------------------
def run_hf(folder: Path, args: argparse.Namespace) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainerCallback, TrainingArguments
    from transformers.data.data_collator import DataCollatorForSeq2Seq

    torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(folder / "model")
    rows = [
        {"input_ids": ids, "attention_mask": [1] * len(ids), "labels": labels}
        for ids, labels in encode(folder, "train")
    ]
    model = AutoModelForCausalLM.from_pretrained(folder / "model", attn_implementation="sdpa")
    if args.method == "lora":  # peft's LoRA on every linear of the blocks (LLaMA-Factory's lora_target: all)
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(
            r=args.rank, lora_alpha=2 * args.rank, lora_dropout=0.0, target_modules="all-linear"
        )
        model = get_peft_model(model, lora)
    on_cuda = args.device == "cuda"
    seen: list[tuple[int, int]] = []  # (real tokens, target tokens) per batch, in order
    pad = DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=-100)

    def collate(features: list[dict]) -> dict:
        batch = pad(features)
        seen.append(
            (int(batch["attention_mask"].sum()), int((batch["labels"] != -100).sum()) - len(features))
        )
        return batch

    marks: dict[str, float] = {}

    class Clock(TrainerCallback):
        def on_step_end(self, a, state, control, **kw):
            if state.global_step == 1:
                marks["after_first"] = time.perf_counter()

    steps_per_epoch = -(-len(rows) // args.batch)
    targs = TrainingArguments(
        output_dir=str(folder / "hf_out"),
        per_device_train_batch_size=args.batch,
        gradient_accumulation_steps=1,
        num_train_epochs=1,
        learning_rate=args.lr,
        weight_decay=0.0,
        adam_beta1=0.9,
        adam_beta2=0.95,
        adam_epsilon=1e-8,
        max_grad_norm=1.0,
        lr_scheduler_type="cosine",
        warmup_steps=int(0.05 * steps_per_epoch),
        logging_steps=10_000,
        save_strategy="no",
        report_to=[],
        use_cpu=not on_cuda,
        bf16=args.precision == "bf16",
        seed=args.seed,
        dataloader_num_workers=0,
        disable_tqdm=True,
        remove_unused_columns=False,
    )
    trainer = Trainer(model=model, args=targs, train_dataset=rows, data_collator=collate, callbacks=[Clock()])
    start = time.perf_counter()
    trainer.train()
    end = time.perf_counter()
    trainer.save_model(str(folder / "hf_final"))
    # The shifted labels: HF drops each sample's first label; we counted labels minus one per sample above.
    timed = seen[1:steps_per_epoch]
    return _report(
        "hf_trainer", folder / "hf_final", end - start, end - marks["after_first"], timed, steps_per_epoch
    )


# ---- side B: shardforge ----------------------------------------------------------------------------------
def run_shardforge(folder: Path, args: argparse.Namespace) -> dict:
    from shardforge.config import load_config  # (threads: the config's hardware.threads)
    from shardforge.train.trainer import Trainer

    job = json.loads((folder / "job.json").read_text())
    overrides = [
        f"train.compile={str(args.compile).lower()}",
        f"train.seed={args.seed}",
        f"train.precision={args.precision}",
        f"hardware.device={args.device}",
        *args.sf_override,
    ]
    cfg = load_config(
        None,
        overrides,
        base={
            "output_dir": str(folder / "sf_out"),
            "model": {"path": str(folder / "model")},
            "data": {
                "train": [{"path": str(folder / "train.jsonl"), "format": "alpaca"}],
                "max_length": job["max_length"],
                "cache": False,  # every run tokenizes, as HF's does
            },
            "train": {
                "epochs": 1,
                "steps": None,
                "micro_batch": job["micro_batch"],
                "lr": args.lr,
                "schedule": "cosine",
                "min_lr_ratio": 0.0,
                "warmup_ratio": 0.05,
                "clip": 1.0,
                "betas": [0.9, 0.95],
                "log_every": 1,  # each step's MFU (a host sync per step: nothing on CPU)
            },
            "log": {"tensorboard": False, "plot": False, "progress": False},
            "hardware": {"threads": args.threads},
            "method": {
                "finetuning": args.method,
                "lora": {"rank": args.rank, "alpha": 2 * args.rank, "targets": "all"},
            },
        },
    )
    trainer = Trainer(cfg)
    mfu: list[float] = []
    trainer.add_hook("log", lambda _t, _step, record: mfu.append(record["mfu"]))
    step_counts: list[tuple[int, int]] = []
    marks: dict[str, float] = {}
    untimed_step = trainer.train_step

    def timed_step():
        loss, norm, counts = untimed_step()
        step_counts.append((counts["tokens"], counts["targets"]))
        if len(step_counts) == 1:
            marks["after_first"] = time.perf_counter()
        return loss, norm, counts

    trainer.train_step = timed_step
    start = time.perf_counter()
    trainer.train()
    end = time.perf_counter()
    report = _report(
        "shardforge",
        folder / "sf_out" / "final",
        end - start,
        end - marks["after_first"],
        step_counts[1:],
        trainer.total_steps,
    )
    return report | {"mfu": statistics.median(mfu[1:] or mfu)}  # steady state: after step 1


def _report(
    side: str, final: Path, wall: float, timed: float, counts: list[tuple[int, int]], steps: int
) -> dict:
    tokens, targets = sum(c[0] for c in counts), sum(c[1] for c in counts)
    return {
        "side": side,
        "final": str(final),
        "steps": steps,
        "wall_s": wall,
        "timed_s": timed,
        "tokens_per_s": tokens / timed,
        "target_tokens_per_s": targets / timed,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


# ---- one evaluator for both ------------------------------------------------------------------------------
def held_out_loss(folder: Path, final: Path, method: str) -> float:
    """Mean next-token loss over response tokens of the held-out set, one document at a time (for LoRA: the
    adapter folder, loaded by peft over the base, merged)."""
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    if method == "lora":
        from peft import PeftModel

        base = AutoModelForCausalLM.from_pretrained(folder / "model")
        model = PeftModel.from_pretrained(base, final).merge_and_unload().eval()
    else:
        model = AutoModelForCausalLM.from_pretrained(final).eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for ids, labels in encode(folder, "eval"):
            logits = model(torch.tensor([ids])).logits[0, :-1]
            target = torch.tensor(labels[1:])
            total += F.cross_entropy(logits, target, ignore_index=-100, reduction="sum").item()
            count += int((target != -100).sum())
    return total / count


# ---- driver ----------------------------------------------------------------------------------------------
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="llama-10m")
    parser.add_argument("--real", default=None, help="a real HF model folder instead of the toy model")
    parser.add_argument("--data", default=None, help="with --real: an alpaca-format .json/.jsonl file")
    parser.add_argument("--records", type=int, default=1200)
    parser.add_argument("--eval-records", type=int, default=200)
    parser.add_argument(
        "--batch", type=int, default=8, help="HF samples per step (shardforge: same on average)"
    )
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--method", default="full", choices=["full", "lora"], help="lora: peft vs ours")
    parser.add_argument("--rank", type=int, default=8, help="LoRA rank (alpha = 2 x rank)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--compile", action="store_true", help="shardforge with train.compile=true")
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--sf-override", nargs="*", default=[], help="extra shardforge overrides (say so)")
    parser.add_argument(
        "--only", choices=["hf", "shardforge"], help="run one side (for A/B runs of a change; no ratios)"
    )
    parser.add_argument("--side", choices=["hf", "shardforge"], help=argparse.SUPPRESS)
    parser.add_argument("--job", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help="write the JSON results here")
    args = parser.parse_args()
    if bool(args.real) != bool(args.data):
        parser.error("--real and --data go together: a model folder and its records")
    sys.path.insert(0, str(REPO))
    if args.side:  # a child process: run one side, print its JSON
        result = (run_hf if args.side == "hf" else run_shardforge)(Path(args.job), args)
        print("RESULT " + json.dumps(result))
        return

    with tempfile.TemporaryDirectory() as tmp:
        job = Path(tmp)
        build_job(job, args)
        runs: dict[str, list[dict]] = {"hf": [], "shardforge": []}
        for rep in range(args.repeats):
            order = ("hf", "shardforge") if rep % 2 == 0 else ("shardforge", "hf")
            for side in [s for s in order if args.only in (None, s)]:
                cmd = [
                    sys.executable,
                    __file__,
                    "--side",
                    side,
                    "--job",
                    str(job),
                    "--seed",
                    str(rep),
                    *_forward(args),
                ]
                started = time.perf_counter()
                proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
                process_s = time.perf_counter() - started
                line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
                if line is None:
                    raise SystemExit(f"{side} failed:\n{proc.stderr[-3000:]}")
                result = json.loads(line[7:]) | {"process_s": process_s}
                result["held_out_loss"] = held_out_loss(job, Path(result["final"]), args.method)
                runs[side].append(result)
                print(
                    f"[{rep + 1}/{args.repeats}] {side}: {result['target_tokens_per_s']:.0f} target tok/s, "
                    f"held-out loss {result['held_out_loss']:.4f}",
                    flush=True,
                )
    keys = ("process_s", "wall_s", "timed_s", "tokens_per_s", "target_tokens_per_s", "held_out_loss")
    keys += ("peak_rss_mib", "steps", "mfu")
    summary = {
        side: {key: statistics.median(r[key] for r in rs) for key in keys if key in rs[0]}
        for side, rs in runs.items()
        if rs
    }
    if args.only:
        print(json.dumps(summary[args.only], indent=2))
        return
    hf, sf = summary["hf"], summary["shardforge"]
    summary["speedup_target_tokens"] = sf["target_tokens_per_s"] / hf["target_tokens_per_s"]
    summary["speedup_process"] = hf["process_s"] / sf["process_s"]
    result = {"args": vars(args), "median": summary, "runs": runs}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps(summary, indent=2))
    print("\n| | HF Trainer | shardforge | ratio |\n|---|---|---|---|")
    whole = summary["speedup_process"]
    print(f"| whole process (s) | {hf['process_s']:.4g} | {sf['process_s']:.4g} | {whole:.2f}x faster |")
    for key, label in (
        ("wall_s", "training wall time (s)"),
        ("tokens_per_s", "tokens/s (all real tokens)"),
        ("target_tokens_per_s", "target tokens/s"),
        ("held_out_loss", "held-out loss"),
        ("peak_rss_mib", "peak RSS (MiB)"),
        ("steps", "optimizer steps"),
    ):
        print(f"| {label} | {hf[key]:.4g} | {sf[key]:.4g} | {sf[key] / hf[key]:.2f} |")
    print(f"| MFU, steady state | | {sf['mfu']:.3f} | |")


def _forward(args: argparse.Namespace) -> list[str]:
    """The options a child process needs to run one side exactly as asked."""
    out = ["--preset", args.preset, "--batch", str(args.batch), "--lr", str(args.lr), "--method", args.method]
    out += ["--real", args.real, "--data", args.data] if args.real else []
    out += ["--rank", str(args.rank)]
    out += ["--threads", str(args.threads), "--device", args.device, "--precision", args.precision]
    out += ["--sf-override", *args.sf_override] if args.sf_override else []
    return out + (["--compile"] if args.compile else [])


if __name__ == "__main__":
    main()
