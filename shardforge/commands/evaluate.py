"""`shardforge eval`: predictions scored by BLEU/ROUGE (--data), or lm-evaluation-harness tasks (--tasks)."""

from __future__ import annotations

import argparse

from rich.console import Console

from shardforge.commands.arg_types import at_least
from shardforge.commands.inference import add_inference_flags, as_ranks, engine_for, sampling_params
from shardforge.errors import ConfigError


def _cmd_eval(args: argparse.Namespace, console: Console) -> int:
    """Prediction with generation and BLEU/ROUGE (--data), or lm-evaluation-harness tasks (--tasks)."""
    import json
    import time
    from pathlib import Path

    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out}: a file is there; give a folder to write the results in")
    if args.tasks:
        if args.tp > 1:
            raise ConfigError("--tasks runs on one process: drop --tp (it applies to --data)")
        from shardforge.eval.harness import (
            ShardforgeLM,
            check_tasks,
            run_tasks,
            summary,
            task_manager,
            write_results,
        )

        tasks = [t for t in args.tasks.split(",") if t]
        manager = task_manager(tasks, args.include_path)  # a wrong name fails before the model loads
        check_tasks(tasks, manager)  # and a wrong task YAML
        import logging

        logging.getLogger("lm_eval").setLevel(logging.ERROR)  # not its notes on every custom task
        with engine_for(args, console) as driven:
            assert driven is not None  # one process
            max_gen_toks = args.max_new_tokens or 256  # a task's own generation_kwargs come first (HFLM's)
            lm = ShardforgeLM(engine=driven[1], batch_size=args.batch_size, max_gen_toks=max_gen_toks)
            results = run_tasks(lm, tasks, manager, args.limit, args.num_fewshot, args.seed or 0)
        written = write_results(results, out)
        for task, metrics in summary(results).items():
            shown = ", ".join(f"{k.split(',')[0]} {v:.4f}" for k, v in metrics.items() if "stderr" not in k)
            console.print(f"{task}: {shown}", highlight=False)
        console.print(f"wrote {written}")
        return 0
    from shardforge.data.templates import resolve_template
    from shardforge.eval.predict import (
        METRICS,
        PREDICTIONS,
        dataset_specs,
        predict,
        prompt_items,
        read_records,
        write_predictions,
    )

    params = sampling_params(args, max_tokens=args.max_new_tokens or 1024)  # LLaMA-Factory's default
    specs = dataset_specs(
        [d for d in args.data.split(",") if d], args.dataset_info, args.format, args.max_samples
    )
    records = read_records(specs, args.system)  # bad data fails before the model loads
    from shardforge.eval.similarity import require_libraries

    require_libraries()  # and a missing scorer
    if (code := as_ranks(args)) is not None:
        return code
    with engine_for(args, console) as driven:
        if driven is None:
            return 0
        loaded, engine = driven
        items = prompt_items(records, loaded.tokenizer, resolve_template(loaded.tokenizer, args.template),
                             args.cutoff_len)  # fmt: skip
        started = time.perf_counter()
        predictions = predict(engine, items, params)
        metrics = write_predictions(predictions, out, time.perf_counter() - started)
    console.print(json.dumps(metrics, indent=2), highlight=False)
    console.print(f"wrote {out / PREDICTIONS} and {out / METRICS}")
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    """`shardforge eval`: the flags, and the handler as `func`."""
    p_eval = sub.add_parser(
        "eval",
        help="evaluate a model: answers generated for a data set with BLEU/ROUGE (--data, LLaMA-Factory's "
        "do_predict), or lm-evaluation-harness tasks (--tasks)",
    )
    add_inference_flags(p_eval, sampling=False)
    what = p_eval.add_mutually_exclusive_group(required=True)
    what.add_argument(
        "--data", help="data sets to predict: files or folders, or dataset_info.json names (A,B)"
    )
    what.add_argument("--tasks", help="lm-eval tasks (A,B): its own, the bundled shardforge_tiny_mc, ...")
    p_eval.add_argument("--out", default="eval", help="the folder the predictions or results go to")
    p_eval.add_argument("--dataset-info", help="--data names: their dataset_info.json (or its folder)")
    p_eval.add_argument("--format", choices=["alpaca", "sharegpt", "openai"], help="--data files' format")
    p_eval.add_argument("--max-samples", type=at_least(1), help="records read per data set at most")
    p_eval.add_argument("--template", default="auto", choices=["auto", "chatml"], help="the chat template")
    p_eval.add_argument("--system", help="the system message of conversations that have none")
    p_eval.add_argument(
        "--cutoff-len", type=at_least(2), help="prompt + label cut as LLaMA-Factory's cutoff_len"
    )
    p_eval.add_argument(
        "--max-new-tokens",
        type=at_least(1),
        help="new tokens per answer at most (default: --data 1024, LLaMA-Factory's; --tasks 256, lm-eval's)",
    )
    p_eval.add_argument("--temperature", type=float, default=0.0, help="0: greedy (the default)")
    p_eval.add_argument("--top-k", type=int, default=None)
    p_eval.add_argument("--top-p", type=float, default=None)
    p_eval.add_argument("--min-p", type=float, default=None)
    p_eval.add_argument("--repetition-penalty", type=float, default=None)
    p_eval.add_argument("--seed", type=int, default=None)
    p_eval.add_argument("--include-path", help="--tasks: a folder of more lm-eval task YAMLs")
    p_eval.add_argument("--limit", type=at_least(1), help="--tasks: items per task at most")
    p_eval.add_argument("--num-fewshot", type=at_least(0), help="--tasks: examples shown before each item")
    p_eval.add_argument("--batch-size", type=at_least(1), default=16, help="--tasks: rows per forward")
    p_eval.set_defaults(func=_cmd_eval)
