"""The `shardforge` command. Thin: parses arguments, builds a Config, calls the library."""

from __future__ import annotations

import argparse
import os
import platform
import sys
from collections.abc import Callable
from typing import Any

from rich.console import Console
from rich.text import Text

from shardforge.cli_launch import add_launch_parser
from shardforge.errors import ConfigError, ShardforgeError


def _agent_mode(args: argparse.Namespace) -> bool:
    """`train --nnodes N` / `--rdzv-endpoint`: this process is one node's elastic agent, never a rank itself
    (whatever RANK, or SLURM's task variables, its launcher set: srun's one task per node, PyTorchJob)."""
    return getattr(args, "nnodes", 1) > 1 or getattr(args, "rdzv_endpoint", None) is not None


def _cmd_train(args: argparse.Namespace, console: Console) -> int:
    from shardforge.config import load_config
    from shardforge.launch import Rendezvous, already_a_rank, launch_local, parse_endpoint

    rendezvous = Rendezvous()
    if _agent_mode(args):  # flags checked before the config, so a typo in them fails first and alone
        if args.rdzv_endpoint is None:
            raise ShardforgeError(f"--nnodes {args.nnodes} needs --rdzv-endpoint HOST:PORT (the first node)")
        if args.nnodes > 1 and not args.rdzv_id:
            raise ShardforgeError(f"--nnodes {args.nnodes} needs --rdzv-id ID, the same on every node")
        parse_endpoint(args.rdzv_endpoint)
        rendezvous = Rendezvous(args.nnodes, args.rdzv_endpoint, args.rdzv_id)
    config = load_config(args.config, args.overrides)  # a bad config fails here, before torch is imported
    if _agent_mode(args) or (
        (args.nproc > 1 or args.max_restarts > 0) and not already_a_rank(translate=False)
    ):
        from shardforge.models.build import model_source
        from shardforge.planner.preflight import resolve_layout

        # Restarts need the elastic agent, even for a single process.
        # Layout errors surface here, once, before any process starts. Every node's agent must choose the
        # same `parallel: auto` layout: no measured (per-node) CPU peak in the search when there are several.
        world = rendezvous.nnodes * args.nproc
        shape = model_source(config.model)[0]
        resolved = resolve_layout(config, world, shape, measure=rendezvous.nnodes == 1)
        dims, estimate = resolved.dims, resolved.estimate
        overrides = list(args.overrides)
        if config.parallel.auto:  # the ranks run the layout chosen here (their own searches could differ)
            console.print(f"parallel: auto chose {estimate.layout.describe()} on {dims.world_size} ranks")
            overrides += ["parallel.auto=false", *estimate.layout.overrides()]
        argv = (["--debug"] if args.debug else []) + ["train", args.config, *overrides]
        return launch_local(args.nproc, args.max_restarts, argv, rendezvous)
    from shardforge.train.trainer import train

    result = train(config, console)
    eval_part = f", eval loss {result.eval_loss:.4f}" if result.eval_loss is not None else ""
    console.print(
        f"done: {result.steps} steps, final loss {result.final_loss:.4f}{eval_part}; "
        f"run folder {result.run_dir}"
    )
    return 0


def _cmd_plan(args: argparse.Namespace, console: Console) -> int:
    import json

    from shardforge.config import load_config
    from shardforge.planner.hardware import PRESETS

    if args.list_hardware:
        for name, d in PRESETS.items():
            peaks = ", ".join(f"{k} {v / 1e12:.4g}" for k, v in d.peak.items())
            console.print(f"{name:<12} {d.description}; TFLOP/s {peaks}", highlight=False)
        return 0
    if args.config is None:
        raise SystemExit("shardforge plan: give a config (or --list-hardware)")
    from shardforge.models.build import planning_shape
    from shardforge.planner.hardware import cluster_for
    from shardforge.planner.report import as_json, table
    from shardforge.planner.search import Planner

    overrides = [*args.overrides]
    flags = {"preset": args.hardware, "nodes": args.nodes, "devices_per_node": args.devices_per_node}
    overrides += [f"hardware.{k}={v}" for k, v in flags.items() if v is not None]
    config = load_config(args.config, overrides)
    shape = planning_shape(config.model)  # no weights needed
    hardware = config.hardware
    world = hardware.nodes * (hardware.devices_per_node or args.nproc)
    planner = Planner(config, shape, cluster_for(hardware, world))
    if args.estimate:
        return _estimate(planner, world, args.json, console)
    plan = planner.search(keep=args.top)
    if args.json:
        print(json.dumps(as_json(plan), indent=1))
    elif not plan.ranked:
        console.print(f"[red]no layout fits[/]: {plan.rejected}")
        for kind, c in plan.examples.items():
            console.print(f"  {kind}: {c.layout.describe()}: {c.rejected}", highlight=False)
        return 1
    else:
        table(plan, console)
    return 0 if plan.ranked else 1


def _estimate(planner: Any, world: int, as_json: bool, console: Console) -> int:
    """`plan --estimate`: the config's explicit layout on the planned cluster (its rules first), and where
    it ranks among the searched layouts."""
    import json

    from shardforge.planner.layout import layout_of
    from shardforge.planner.report import candidate_json, estimate_table, standing

    if planner.cfg.parallel.auto:
        raise ConfigError("plan --estimate: the config says parallel: auto; give it a layout to estimate")
    estimate = planner.evaluate(layout_of(planner.cfg, world))
    if estimate.kind == "rules":
        raise ConfigError(f"the config's layout breaks a rule: {estimate.rejected}")
    plan = planner.search(keep=10**9)  # every layout that fits, to rank this one among
    if as_json:
        answer = {"estimate": candidate_json(estimate), "standing": standing(estimate, plan),
                  "best": candidate_json(plan.best) if plan.ranked else None}  # fmt: skip
        print(json.dumps(answer, indent=1))
    else:
        estimate_table(estimate, plan, console)
    return 0 if estimate.fits else 1


def _cmd_export(args: argparse.Namespace, console: Console) -> int:
    from pathlib import Path

    from shardforge.checkpoint.export import export
    from shardforge.log import log_to_console

    log_to_console(console)  # a damaged checkpoint skipped is a warning
    base = Path(args.base) if args.base else None
    checkpoint, out, what = export(Path(args.source), Path(args.to), args.merge, base)
    console.print(f"exported {checkpoint} to {out}: {what}, with the tokenizer")
    return 0


def _cmd_expand(args: argparse.Namespace, console: Console) -> int:
    """LLaMA Pro's block expansion of an HF folder (LLaMA-Factory's scripts/llama_pro.py)."""
    from pathlib import Path

    from shardforge.models.expand import expand_blocks

    folder = expand_blocks(Path(args.model), Path(args.to), args.blocks)
    console.print(
        f"expanded {args.model} by {args.blocks} blocks into {folder}; train the new blocks with "
        f"model.path={folder} method.finetuning=freeze method.freeze.llama_pro=true "
        f"method.freeze.trainable_layers={args.blocks}"
    )
    return 0


def _cmd_loftq(args: argparse.Namespace, console: Console) -> int:
    """LoftQ's base and adapter for QLoRA (LLaMA-Factory's scripts/loftq_init.py)."""
    from pathlib import Path

    from shardforge.adapters.loftq import ADAPTER, loftq_folder

    targets = tuple(t for t in args.targets.split(",") if t)
    folder = loftq_folder(Path(args.model), Path(args.to), args.rank, args.alpha, targets, args.iter)
    alpha = args.alpha or 2 * args.rank
    console.print(
        f"wrote the LoftQ base to {folder} and its adapter to {folder / ADAPTER}; train them as QLoRA with "
        f"model.path={folder} model.adapter={folder / ADAPTER} model.quantize=nf4 method.finetuning=lora "
        f"method.lora.rank={args.rank} method.lora.alpha={alpha} method.lora.targets=[{','.join(targets)}]"
    )
    return 0


def _cmd_convert(args: argparse.Namespace, console: Console) -> int:
    """A LLaMA-Factory YAML as a shardforge config: printed (or written with --to), checked by the schema."""
    from pathlib import Path

    import yaml

    from shardforge.config import load_config
    from shardforge.config.lf_convert import convert_lf

    source = Path(args.source)
    if not source.is_file():
        raise ConfigError(f"{source}: no such LLaMA-Factory config file")
    lf = yaml.safe_load(source.read_text()) or {}
    if not isinstance(lf, dict):
        raise ConfigError(f"{source}: a LLaMA-Factory config is a YAML mapping of keys to values")
    out = convert_lf(lf)
    if out.unsupported and not args.allow_unsupported:
        console.print(
            f"{source}: LLaMA-Factory keys shardforge cannot honour (the run would train something else):",
            highlight=False, markup=False,
        )  # fmt: skip
        for item in out.unsupported:
            console.print(f"  {item}", highlight=False, markup=False)
        console.print(
            "remove them, or convert anyway with --allow-unsupported (they are then listed in the config)"
        )
        return 2
    if out.command is not None:  # a merge / export or inference YAML
        for item in out.unsupported:
            console.print(f"[yellow]warning:[/] not carried over: {item}", highlight=False)
        console.print(
            f"{source} is not a training run; the shardforge command doing what it does:\n{out.command}"
        )
        return 0
    load_config(None, base=out.config)  # a key or value the schema refuses is an error here, with its name
    lines = [f"# converted from {source} (LLaMA-Factory) by shardforge convert"]
    lines += [f"# note: {n}" for n in out.notes]
    lines += [f"# UNSUPPORTED (--allow-unsupported), not honoured: {k}" for k in out.unsupported]
    text = "\n".join(lines) + "\n" + yaml.safe_dump(out.config, sort_keys=False)
    if args.to:
        Path(args.to).write_text(text)
        console.print(f"wrote {args.to}", highlight=False)
    else:
        console.print(text, highlight=False, markup=False, end="")
    for item in out.unsupported:
        console.print(f"[yellow]warning:[/] not honoured: {item}", highlight=False)
    return 0


def _cmd_data_prepare(args: argparse.Namespace, console: Console) -> int:
    from shardforge.config import load_config
    from shardforge.data.build import prepare_data
    from shardforge.log import log_to_console
    from shardforge.objectives import build_objective, reading_of

    config = load_config(args.config, args.overrides)
    objective = build_objective(config.method)
    log_to_console(console)
    report = prepare_data(config, objective, reading_of(objective, config.data.default_system))
    for what, stats in report.items():
        histogram = stats.pop("length_histogram")
        console.print(
            f"{what}: "
            + ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in stats.items())
        )
        console.print(
            f"{what} sequence lengths (tokens: count): "
            + ", ".join(f"{k}: {v}" for k, v in histogram.items())
        )
    return 0


def _cmd_webui(args: argparse.Namespace, console: Console) -> int:
    """The browser face: forms over the same config, the same `shardforge train` launched as a process."""
    from shardforge.extras import require
    from shardforge.webui.access import Root, require_auth

    require("webui", "shardforge webui")

    credentials, warning = require_auth(args.host, args.auth)  # before anything starts
    root = Root(args.root)
    if warning:
        console.print(f"[yellow]warning:[/] {warning}")
    from shardforge.webui.app import serve

    os.chdir(root.folder)  # the form's relative paths mean what they mean to the jobs it launches there
    console.print(f"web UI on http://{args.host}:{args.port}/ (files under {root.folder}; Ctrl-C stops)")
    serve(root, args.host, args.port, credentials)
    return 0


def _cmd_env(args: argparse.Namespace, console: Console) -> int:
    import torch
    import transformers

    from shardforge import __version__
    from shardforge.models import preset_names, supported
    from shardforge.models.generic.spec import generic_families
    from shardforge.planner.peak import peak_flops

    rows = [
        ("shardforge", __version__),
        ("python", platform.python_version()),
        ("torch", torch.__version__),
        ("transformers", transformers.__version__),
        ("platform", platform.platform()),
        ("cpu cores", str(os.cpu_count())),
        ("torch threads", str(torch.get_num_threads())),
        ("cuda", f"{torch.cuda.device_count()} device(s)" if torch.cuda.is_available() else "not available"),
        ("distributed backends", ", ".join(b for b in ("gloo", "nccl", "mpi") if _has_backend(b))),
        ("model families", f"native: {', '.join(supported())}"),
        (
            "",
            f"generic backend (model.backend: auto | hf): any of transformers' {generic_families()} causal "
            f"LM types, through its own modules (no pipeline / context / expert / sequence parallel)",
        ),
        ("presets", ", ".join(preset_names())),
    ]
    for i in range(torch.cuda.device_count()):
        rows.append((f"cuda:{i}", torch.cuda.get_device_name(i)))
    peak, source = peak_flops(torch.device("cpu"), torch.float32)
    rows.append(("peak fp32 (cpu)", f"{peak / 1e9:.1f} GFLOP/s ({source})"))
    if torch.cuda.is_available():
        peak, source = peak_flops(torch.device("cuda"), torch.bfloat16)
        rows.append(("peak bf16 (cuda)", f"{peak / 1e12:.1f} TFLOP/s ({source})"))
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        console.print(f"{key:<{width}}  {value}", highlight=False)
    return 0


def _engine_for(args: argparse.Namespace, console: Console):
    """The inference commands' engine over what they name (a context manager; None on a TP follower)."""
    from shardforge.infer.engine import EngineConfig
    from shardforge.infer.session import inference_engine
    from shardforge.log import log_to_console

    log_to_console(console)  # the library's warnings (a damaged checkpoint skipped), on this console
    config = EngineConfig(
        block_size=args.block_size,
        kv_memory_bytes=int(args.kv_memory_gb * (1 << 30)),
        max_running=args.max_running,
        max_step_tokens=args.max_step_tokens,
        speculative=_speculative(args),
    )
    console.print(f"loading {args.model}" + (f" over {args.tp} tensor-parallel ranks" if args.tp > 1 else ""))
    return inference_engine(
        args.model,
        args.adapter,
        args.dtype,
        args.device,
        config,
        args.tp,
        not args.no_prepack,
        _quantize(args),
        _loras(args),
        draft=args.draft,
    )


def _speculative(args: argparse.Namespace):
    """--speculative ngram / --draft MODEL with their sizes as a SpeculativeConfig (None: off); bad values
    fail before loading, naming the flag."""
    from shardforge.errors import ConfigError
    from shardforge.infer.speculative import SpeculativeConfig

    if args.speculative is None and args.draft is None:
        return None
    if args.speculative is not None and args.draft is not None:
        raise ConfigError("--draft and --speculative ngram: choose one way of drafting")
    method = "draft" if args.draft is not None else "ngram"
    spec = SpeculativeConfig(
        method, args.num_speculative_tokens, args.prompt_lookup_min, args.prompt_lookup_max
    )
    return spec.check(args.max_step_tokens)


def _loras(args: argparse.Namespace):
    """serve's --lora NAME=FOLDER adapters ([] with --lora-root alone: loaded at run time; None: off)."""
    from shardforge.infer.multi_lora import parse_lora_flags

    if not getattr(args, "lora", None) and not getattr(args, "lora_root", None):
        return None
    return parse_lora_flags(args.lora)


def _quantize(args: argparse.Namespace):
    """--quantize / --group-size as a Quantization (None: full precision); bad values fail before loading."""
    from shardforge.infer.quantized import Quantization

    if args.quantize is None:
        if args.group_size is not None:
            raise ConfigError("--group-size goes with --quantize int4")
        return None
    if args.group_size is not None and args.quantize != "int4":
        raise ConfigError(f"--group-size goes with --quantize int4, not --quantize {args.quantize}")
    return Quantization(args.quantize, args.group_size or 128).check()


def _as_ranks(args: argparse.Namespace, stop_grace: float | None = None) -> int | None:
    """--tp N from a plain command: start N ranks of the same command (its exit code); else None.
    `stop_grace`: SIGTERM is how the command ends, within that many seconds (serve)."""
    from shardforge.launch import already_a_rank, launch_local

    quantize = _quantize(args)  # bad quantization flags fail before any rank starts
    if _loras(args) is not None and args.tp > 1:
        raise ConfigError(f"--lora with --tp {args.tp}: many adapters on one base run on one process")
    if quantize is not None and args.tp > 1:
        raise ConfigError(
            f"--quantize {quantize.scheme} with --tp {args.tp}: quantized weights run on one process"
        )
    if args.tp > 1 and not already_a_rank(translate=False):
        return launch_local(args.tp, 0, args.argv, stop_grace=stop_grace)
    return None


def _sampling(args: argparse.Namespace, max_tokens: int | None = None):
    """The sampling flags as SamplingParams (`max_tokens`: eval's --max-new-tokens, else --max-tokens)."""
    from shardforge.infer.sampling import SamplingParams

    return SamplingParams(
        max_tokens=max_tokens if max_tokens is not None else args.max_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        seed=args.seed,
    ).check()


def _cmd_generate(args: argparse.Namespace, console: Console) -> int:
    import time
    from pathlib import Path

    from shardforge.infer.offline import generate_file

    params = _sampling(args)  # bad flags fail before the model loads
    if (code := _as_ranks(args)) is not None:
        return code
    with _engine_for(args, console) as driven:
        if driven is None:
            return 0
        loaded, engine = driven
        started = time.perf_counter()
        with console.status("generating") as status:
            counts = generate_file(
                engine,
                Path(args.prompts),
                Path(args.out),
                params,
                lambda d, t: status.update(f"generated {d}/{t}"),
                loaded.images,
            )
    seconds = time.perf_counter() - started
    console.print(
        f"wrote {counts['prompts']} results to {args.out}: {counts['tokens']} tokens in {seconds:.1f} s "
        f"({counts['tokens'] / seconds:.1f} tokens/s)"
    )
    return 0


def _cmd_chat(args: argparse.Namespace, console: Console) -> int:
    from shardforge.infer.offline import chat_loop

    params = _sampling(args)
    if (code := _as_ranks(args)) is not None:
        return code
    with _engine_for(args, console) as driven:
        if driven is not None:
            chat_loop(driven[1], params, reader=driven[0].images)
    return 0


def _cmd_serve(args: argparse.Namespace, console: Console) -> int:
    from pathlib import Path

    from shardforge.extras import require

    require("serve", "shardforge serve")
    from shardforge.infer.runner import EngineRunner
    from shardforge.infer.server import check_host, serve

    check_host(args.host, args.api_key)  # before the model loads
    if (code := _as_ranks(args, stop_grace=args.shutdown_grace)) is not None:
        return code
    with _engine_for(args, console) as driven:
        if driven is None:
            return 0
        loaded, engine = driven
        name = args.served_name or loaded.name
        console.print(f"serving {name!r} on http://{args.host}:{args.port}/v1 (OpenAI API; Ctrl-C stops)")
        runner = EngineRunner(engine, args.max_waiting)
        root = Path(args.image_root) if args.image_root else None
        lora_root = Path(args.lora_root) if args.lora_root else None
        serve(loaded, runner, args.host, args.port, name, args.api_key, args.shutdown_grace, root, lora_root)
    return 0


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
        with _engine_for(args, console) as driven:
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

    params = _sampling(args, max_tokens=args.max_new_tokens or 1024)  # LLaMA-Factory's default
    specs = dataset_specs(
        [d for d in args.data.split(",") if d], args.dataset_info, args.format, args.max_samples
    )
    records = read_records(specs, args.system)  # bad data fails before the model loads
    from shardforge.eval.similarity import require_libraries

    require_libraries()  # and a missing scorer
    if (code := _as_ranks(args)) is not None:
        return code
    with _engine_for(args, console) as driven:
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


def _inference_flags(p: argparse.ArgumentParser, sampling: bool = True) -> None:
    p.add_argument("model", help="an HF model folder, a PEFT adapter folder, a run folder or a checkpoint")
    p.add_argument("--adapter", help="a PEFT LoRA adapter folder to merge into the model")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--block-size", type=_at_least(1), default=16, help="KV cache block size (tokens)")
    p.add_argument("--kv-memory-gb", type=float, default=1.0, help="memory for the KV cache")
    p.add_argument("--max-running", type=_at_least(1), default=64, help="sequences decoded together")
    p.add_argument("--max-step-tokens", type=_at_least(1), default=512, help="tokens computed per step")
    p.add_argument("--tp", type=_at_least(1), default=1, help="tensor-parallel ranks (the training TP plan)")
    p.add_argument(
        "--speculative",
        choices=["ngram"],
        default=None,
        help="speculative decoding by prompt lookup: draft tokens from earlier n-grams, no second model",
    )
    p.add_argument("--draft", default=None, help="speculative decoding by a draft model (same tokenizer)")
    p.add_argument("--num-speculative-tokens", type=int, default=4, help="draft tokens proposed a step")
    p.add_argument("--prompt-lookup-min", type=int, default=1, help="--speculative ngram: shortest n-gram")
    p.add_argument("--prompt-lookup-max", type=int, default=3, help="--speculative ngram: longest n-gram")
    p.add_argument(
        "--no-prepack",
        action="store_true",
        help="keep the weights in their plain layout (by default, on CPU, they are laid out once for oneDNN)",
    )
    p.add_argument(
        "--quantize",
        choices=["int8", "int4"],
        default=None,
        help="weight-only int8 or int4 (group-wise) block linears and LM head, quantized at load",
    )
    p.add_argument(
        "--group-size",
        type=_at_least(1),
        default=None,
        help="int4: inputs per scale and zero, one of 32, 64, 128 (default), 256",
    )
    if sampling:
        p.add_argument("--max-tokens", type=_at_least(1), default=None, help="new tokens at most")
        p.add_argument("--temperature", type=float, default=None, help="0: greedy")
        p.add_argument("--top-k", type=int, default=None)
        p.add_argument("--top-p", type=float, default=None)
        p.add_argument("--min-p", type=float, default=None)
        p.add_argument("--repetition-penalty", type=float, default=None)
        p.add_argument("--seed", type=int, default=None)


def _has_backend(name: str) -> bool:
    import torch.distributed as dist

    return dist.is_available() and getattr(dist, f"is_{name}_available", lambda: False)()


def _seconds(text: str) -> float:
    """An argparse type: a finite number of seconds >= 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return value


def _at_least(low: int) -> Callable[[str], int]:
    """An argparse type: an integer >= low, else a usage error naming the value."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value

    return parse


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shardforge", description="Train and fine-tune LLMs, HF checkpoints in and out."
    )
    parser.add_argument("--debug", action="store_true", help="show full tracebacks for errors")
    sub = parser.add_subparsers(dest="command", required=True)
    p_train = sub.add_parser("train", help="run a training job from a YAML config")
    p_train.add_argument("config", help="path to the YAML config")
    p_train.add_argument(
        "overrides", nargs="*", help="dotted overrides, e.g. train.lr=3e-4 data.max_length=512"
    )
    p_train.add_argument(
        "--nproc", type=_at_least(1), default=1, help="processes (ranks) to start on this machine"
    )
    p_train.add_argument(
        "--max-restarts", type=_at_least(0), default=0, help="restart the job this often after a failure"
    )
    p_train.add_argument(
        "--nnodes",
        type=_at_least(1),
        default=1,
        help="nodes of the job: run this node's elastic agent (--nproc ranks), meeting the others' at "
        "--rdzv-endpoint (what `shardforge launch` writes for each node)",
    )
    p_train.add_argument("--rdzv-endpoint", help="HOST:PORT of the first node, where the agents meet")
    p_train.add_argument("--rdzv-id", help="the job's rendezvous id, the same on every node")
    p_train.set_defaults(func=_cmd_train)
    add_launch_parser(sub, _at_least)
    p_plan = sub.add_parser(
        "plan",
        help="choose a parallel layout: memory and step time of the best ones, and why (docs/planner.md)",
    )
    p_plan.add_argument("config", nargs="?", help="path to the YAML config")
    p_plan.add_argument("overrides", nargs="*", help="dotted overrides, e.g. data.max_length=8192")
    p_plan.add_argument("--hardware", help="a device preset (see --list-hardware); default: this machine's")
    p_plan.add_argument("--nodes", type=_at_least(1), help="nodes of the cluster planned for")
    p_plan.add_argument("--devices-per-node", type=_at_least(1), help="devices per node")
    p_plan.add_argument("--nproc", type=_at_least(1), default=1, help="processes here, without --nodes")
    p_plan.add_argument("--top", type=_at_least(1), default=5, help="layouts shown")
    p_plan.add_argument("--json", action="store_true", help="machine-readable output")
    p_plan.add_argument(
        "--estimate",
        action="store_true",
        help="estimate the config's own parallel layout (memory and time by part) and rank it among the rest",
    )
    p_plan.add_argument("--list-hardware", action="store_true", help="the device presets and their figures")
    p_plan.set_defaults(func=_cmd_plan)
    p_export = sub.add_parser(
        "export", help="write a training checkpoint (any layout) as a Hugging Face folder, in one process"
    )
    p_export.add_argument(
        "source",
        help="a checkpoint folder, a run folder (its newest complete checkpoint, else its final/), or a PEFT "
        "adapter folder",
    )
    p_export.add_argument("--to", required=True, help="the folder to write")
    p_export.add_argument(
        "--merge", action="store_true", help="LoRA: merge the adapters into the base (a plain HF folder)"
    )
    p_export.add_argument(
        "--base", default=None, help="a PEFT adapter's base folder (default: its base_model_name_or_path)"
    )
    p_export.set_defaults(func=_cmd_export)
    p_expand = sub.add_parser(
        "expand", help="LLaMA Pro: add zero-output copies of decoder blocks to an HF model folder"
    )
    p_expand.add_argument("model", help="the HF model folder to expand")
    p_expand.add_argument(
        "--blocks", type=_at_least(1), required=True, help="blocks to add (a divisor of the layers)"
    )
    p_expand.add_argument("--to", required=True, help="the folder to write")
    p_expand.set_defaults(func=_cmd_expand)
    p_loftq = sub.add_parser("loftq", help="LoftQ: a 4-bit base and a LoRA adapter that start near the model")
    p_loftq.add_argument("model", help="the HF model folder")
    p_loftq.add_argument("--to", required=True, help="the folder to write (the base; its adapter inside)")
    p_loftq.add_argument(
        "--rank", type=_at_least(1), default=16, help="LoRA rank (LLaMA-Factory's default 16)"
    )
    p_loftq.add_argument("--alpha", type=float, default=None, help="LoRA alpha (default: twice the rank)")
    p_loftq.add_argument("--targets", default="q_proj,v_proj", help="the adapted linears, comma-separated")
    p_loftq.add_argument("--iter", type=_at_least(1), default=4, help="alternating rounds (LF's default 4)")
    p_loftq.set_defaults(func=_cmd_loftq)
    p_convert = sub.add_parser("convert", help="a LLaMA-Factory training YAML as a shardforge config")
    p_convert.add_argument("source", help="the LLaMA-Factory YAML")
    p_convert.add_argument("--to", help="write the config here (default: print it)")
    p_convert.add_argument(
        "--allow-unsupported", action="store_true",
        help="convert even where LLaMA-Factory keys have no counterpart (listed in the config)",
    )  # fmt: skip
    p_convert.set_defaults(func=_cmd_convert)
    p_data = sub.add_parser("data", help="data utilities")
    data_sub = p_data.add_subparsers(dest="data_command", required=True)
    p_prepare = data_sub.add_parser(
        "prepare",
        help="tokenize a config's data into the dataset cache ahead of a job and print its statistics",
    )
    p_prepare.add_argument("config", help="path to the YAML config")
    p_prepare.add_argument("overrides", nargs="*", help="dotted overrides, e.g. data.max_length=2048")
    p_prepare.set_defaults(func=_cmd_data_prepare)
    p_generate = sub.add_parser("generate", help="batch generation from a JSONL file of prompts")
    _inference_flags(p_generate)
    p_generate.add_argument("--prompts", required=True, help="JSONL: prompt, messages or prompt_ids per line")
    p_generate.add_argument("--out", required=True, help="JSONL results, one line per prompt")
    p_generate.set_defaults(func=_cmd_generate)
    p_chat = sub.add_parser("chat", help="chat with a model in the terminal (streams its replies)")
    _inference_flags(p_chat)
    p_chat.set_defaults(func=_cmd_chat)
    p_serve = sub.add_parser("serve", help="an OpenAI-compatible HTTP server")
    _inference_flags(p_serve, sampling=False)
    p_serve.add_argument("--host", default="127.0.0.1", help="a non-loopback host needs --api-key")
    p_serve.add_argument("--port", type=_at_least(0), default=8000)
    p_serve.add_argument("--api-key", default=None, help="clients must send it as a Bearer token")
    p_serve.add_argument("--served-name", default=None, help="the model name clients ask for")
    p_serve.add_argument("--max-waiting", type=_at_least(1), default=256, help="queue length before 429")
    p_serve.add_argument(
        "--shutdown-grace",
        type=_seconds,
        default=5.0,
        help="seconds in-flight requests get to finish after SIGTERM before they are aborted",
    )
    p_serve.add_argument(
        "--image-root",
        default=None,
        help="a vision-language model reads requests' local image paths only under this folder "
        "(without it: data URLs only; remote URLs never)",
    )
    p_serve.add_argument(
        "--lora",
        action="append",
        default=None,
        metavar="NAME=FOLDER",
        help="a PEFT LoRA adapter served on the base unmerged, chosen by a request's model=NAME (repeatable; "
        "requests under different adapters share a batch)",
    )
    p_serve.add_argument(
        "--lora-root",
        default=None,
        help="POST /v1/load_lora_adapter may load adapter folders under this folder (without it: off)",
    )
    p_serve.set_defaults(func=_cmd_serve)
    p_eval = sub.add_parser(
        "eval",
        help="evaluate a model: answers generated for a data set with BLEU/ROUGE (--data, LLaMA-Factory's "
        "do_predict), or lm-evaluation-harness tasks (--tasks)",
    )
    _inference_flags(p_eval, sampling=False)
    what = p_eval.add_mutually_exclusive_group(required=True)
    what.add_argument(
        "--data", help="data sets to predict: files or folders, or dataset_info.json names (A,B)"
    )
    what.add_argument("--tasks", help="lm-eval tasks (A,B): its own, the bundled shardforge_tiny_mc, ...")
    p_eval.add_argument("--out", default="eval", help="the folder the predictions or results go to")
    p_eval.add_argument("--dataset-info", help="--data names: their dataset_info.json (or its folder)")
    p_eval.add_argument("--format", choices=["alpaca", "sharegpt", "openai"], help="--data files' format")
    p_eval.add_argument("--max-samples", type=_at_least(1), help="records read per data set at most")
    p_eval.add_argument("--template", default="auto", choices=["auto", "chatml"], help="the chat template")
    p_eval.add_argument("--system", help="the system message of conversations that have none")
    p_eval.add_argument(
        "--cutoff-len", type=_at_least(2), help="prompt + label cut as LLaMA-Factory's cutoff_len"
    )
    p_eval.add_argument(
        "--max-new-tokens",
        type=_at_least(1),
        help="new tokens per answer at most (default: --data 1024, LLaMA-Factory's; --tasks 256, lm-eval's)",
    )
    p_eval.add_argument("--temperature", type=float, default=0.0, help="0: greedy (the default)")
    p_eval.add_argument("--top-k", type=int, default=None)
    p_eval.add_argument("--top-p", type=float, default=None)
    p_eval.add_argument("--min-p", type=float, default=None)
    p_eval.add_argument("--repetition-penalty", type=float, default=None)
    p_eval.add_argument("--seed", type=int, default=None)
    p_eval.add_argument("--include-path", help="--tasks: a folder of more lm-eval task YAMLs")
    p_eval.add_argument("--limit", type=_at_least(1), help="--tasks: items per task at most")
    p_eval.add_argument("--num-fewshot", type=_at_least(0), help="--tasks: examples shown before each item")
    p_eval.add_argument("--batch-size", type=_at_least(1), default=16, help="--tasks: rows per forward")
    p_eval.set_defaults(func=_cmd_eval)
    p_webui = sub.add_parser("webui", help="a web UI: configure, plan, launch, watch, chat and export")
    p_webui.add_argument("--host", default="127.0.0.1", help="a non-loopback host needs --auth")
    p_webui.add_argument("--port", type=_at_least(0), default=7860)
    p_webui.add_argument("--auth", default=None, help="USER:PASSWORD (or SHARDFORGE_WEBUI_AUTH)")
    p_webui.add_argument("--root", default=".", help="the only folder the UI reads and writes in")
    p_webui.set_defaults(func=_cmd_webui)
    p_env = sub.add_parser("env", help="versions, threads, devices and measured matmul peak")
    p_env.set_defaults(func=_cmd_env)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    # Overrides may come before or after options (`train cfg.yaml --nproc 2 train.lr=1e-3`).
    args, extra = parser.parse_known_args(argv)
    args.argv = argv  # what a command relaunches as ranks
    unknown = [a for a in extra if a.startswith("-") or not hasattr(args, "overrides")]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    from shardforge.launch import already_a_rank

    try:
        # Under srun with a task per rank, turn SLURM's variables into torch's before anything reads RANK (not
        # for a node's agent: srun runs one per node, and the ranks it starts get theirs from torch elastic).
        already_a_rank(translate=not _agent_mode(args))
        console = Console(soft_wrap=True, quiet=os.environ.get("RANK", "0") != "0")  # one voice per job
        return args.func(args, console)
    except ShardforgeError as exc:
        if args.debug:
            raise
        if os.environ.get("RANK", "0") == "0":  # under a launcher every rank fails alike: say it once
            Console(stderr=True, soft_wrap=True).print(Text("error: ", style="bold red") + Text(str(exc)))
        return 2
    except KeyboardInterrupt:
        Console(stderr=True).print("interrupted")
        return 130


if __name__ == "__main__":
    sys.exit(main())
