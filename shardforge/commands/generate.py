"""`shardforge generate`, `chat` and `serve`: the inference engine over a file, a terminal or HTTP."""

from __future__ import annotations

import argparse

from rich.console import Console

from shardforge.commands.arg_types import at_least, seconds
from shardforge.commands.inference import add_inference_flags, as_ranks, engine_for, sampling_params


def _cmd_generate(args: argparse.Namespace, console: Console) -> int:
    import time
    from pathlib import Path

    from shardforge.infer.offline import generate_file

    params = sampling_params(args)  # bad flags fail before the model loads
    if (code := as_ranks(args)) is not None:
        return code
    with engine_for(args, console) as driven:
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

    params = sampling_params(args)
    if (code := as_ranks(args)) is not None:
        return code
    with engine_for(args, console) as driven:
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
    if (code := as_ranks(args, stop_grace=args.shutdown_grace)) is not None:
        return code
    with engine_for(args, console) as driven:
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


def add_parser(sub: argparse._SubParsersAction) -> None:
    """`shardforge generate`, `chat` and `serve`: the flags, and the handler as `func`."""
    p_generate = sub.add_parser("generate", help="batch generation from a JSONL file of prompts")
    add_inference_flags(p_generate)
    p_generate.add_argument("--prompts", required=True, help="JSONL: prompt, messages or prompt_ids per line")
    p_generate.add_argument("--out", required=True, help="JSONL results, one line per prompt")
    p_generate.set_defaults(func=_cmd_generate)
    p_chat = sub.add_parser("chat", help="chat with a model in the terminal (streams its replies)")
    add_inference_flags(p_chat)
    p_chat.set_defaults(func=_cmd_chat)
    p_serve = sub.add_parser("serve", help="an OpenAI-compatible HTTP server")
    add_inference_flags(p_serve, sampling=False)
    p_serve.add_argument("--host", default="127.0.0.1", help="a non-loopback host needs --api-key")
    p_serve.add_argument("--port", type=at_least(0), default=8000)
    p_serve.add_argument("--api-key", default=None, help="clients must send it as a Bearer token")
    p_serve.add_argument("--served-name", default=None, help="the model name clients ask for")
    p_serve.add_argument("--max-waiting", type=at_least(1), default=256, help="queue length before 429")
    p_serve.add_argument(
        "--shutdown-grace",
        type=seconds,
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
