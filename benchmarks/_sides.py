"""What the side-by-side benchmarks (vs_trl.py, vs_trl_grpo.py) share: each side runs in a fresh process (the
same script again with --side), prints its figures as its last line of output, and the parent alternates the
sides `--repeats` times and reports medians."""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

Runner = Callable[[Path, Path, argparse.Namespace], dict]


def add_side_arguments(parser: argparse.ArgumentParser, sides: tuple[str, ...]) -> None:
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=3600)
    parser.add_argument("--results", help="write the JSON here")
    parser.add_argument("--side", choices=sides, help=argparse.SUPPRESS)
    parser.add_argument("--job", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)


def run_child(args: argparse.Namespace, runners: dict[str, Runner]) -> bool:
    """In a child (--side given): run that side and print its figures with the process's peak RSS."""
    if not args.side:
        return False
    figures = runners[args.side](Path(args.job), Path(args.out), args)
    figures["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps(figures))
    return True


def alternate(
    script: str,
    folder: Path,
    args: argparse.Namespace,
    forward: Callable[[argparse.Namespace], list[str]],
    sides: tuple[str, ...],
    evaluate: Callable[[Path, str], dict] | None = None,
) -> dict[str, list[dict]]:
    """Each side in its own process, alternating, `args.repeats` times (seed = the repeat); `evaluate`
    turns a side's "final" (its trained model) into more figures."""
    runs: dict[str, list[dict]] = {side: [] for side in sides}
    for repeat in range(args.repeats):
        args.seed = repeat
        for side in sides:
            out = folder / f"{side}-{repeat}"
            out.mkdir()
            command = [sys.executable, script, "--side", side, "--job", str(folder), "--out", str(out)]
            proc = subprocess.run(
                [*command, *forward(args)], capture_output=True, text=True, timeout=args.timeout
            )
            if proc.returncode != 0:
                raise SystemExit(f"{side} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
            figures = json.loads(proc.stdout.strip().splitlines()[-1])
            if evaluate is not None:
                figures.update(evaluate(folder, figures.pop("final")))
            runs[side].append(figures)
            print(f"{side} repeat {repeat}: {json.dumps(figures)}", file=sys.stderr)
    return runs


def report(args: argparse.Namespace, runs: dict[str, list[dict]]) -> dict:
    """The job's settings, every run and each side's medians."""
    medians = {side: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for side, rs in runs.items()}
    job = {k: v for k, v in vars(args).items() if k not in ("side", "job", "out")}
    return {"job": job, "runs": runs, "median": medians}


def print_table(medians: dict[str, dict], keys: tuple[str, ...]) -> None:
    print("| | " + " | ".join(keys) + " |\n|---|" + "---|" * len(keys))
    for side, figures in medians.items():
        print(f"| {side} | " + " | ".join(f"{figures[k]:.3g}" for k in keys) + " |")


def job_model(folder: Path, model: str | None) -> None:
    """The job's `model` folder: a link to `model`, or a random-init llama-10m with the bundled tokenizer."""
    if model:
        (folder / "model").symlink_to(Path(model).resolve())
        return
    repo = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(repo))
    import torch
    from transformers import AutoTokenizer

    from shardforge.models import build_preset, save_model

    tokenizer = AutoTokenizer.from_pretrained(repo / "examples" / "data" / "tokenizer")
    torch.manual_seed(0)
    save_model(
        build_preset("llama-10m", vocab_size=len(tokenizer), seed=0), folder / "model", tokenizer=tokenizer
    )
