"""The flags and the engine the inference commands (generate, chat, serve, eval) share."""

from __future__ import annotations

import argparse

from rich.console import Console

from shardforge.commands.arg_types import at_least
from shardforge.errors import ConfigError


def add_inference_flags(p: argparse.ArgumentParser, sampling: bool = True) -> None:
    """The model, engine and quantization flags every inference command takes; `sampling`: and the
    sampling flags (serve and eval take theirs elsewhere)."""
    p.add_argument("model", help="an HF model folder, a PEFT adapter folder, a run folder or a checkpoint")
    p.add_argument("--adapter", help="a PEFT LoRA adapter folder to merge into the model")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--block-size", type=at_least(1), default=16, help="KV cache block size (tokens)")
    p.add_argument("--kv-memory-gb", type=float, default=1.0, help="memory for the KV cache")
    p.add_argument("--max-running", type=at_least(1), default=64, help="sequences decoded together")
    p.add_argument("--max-step-tokens", type=at_least(1), default=512, help="tokens computed per step")
    p.add_argument("--tp", type=at_least(1), default=1, help="tensor-parallel ranks (the training TP plan)")
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
        type=at_least(1),
        default=None,
        help="int4: inputs per scale and zero, one of 32, 64, 128 (default), 256",
    )
    if sampling:
        p.add_argument("--max-tokens", type=at_least(1), default=None, help="new tokens at most")
        p.add_argument("--temperature", type=float, default=None, help="0: greedy")
        p.add_argument("--top-k", type=int, default=None)
        p.add_argument("--top-p", type=float, default=None)
        p.add_argument("--min-p", type=float, default=None)
        p.add_argument("--repetition-penalty", type=float, default=None)
        p.add_argument("--seed", type=int, default=None)


def engine_for(args: argparse.Namespace, console: Console):
    """The inference commands' engine over what they name (a context manager; None on a TP follower)."""
    from shardforge.infer.engine_types import EngineConfig
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


def as_ranks(args: argparse.Namespace, stop_grace: float | None = None) -> int | None:
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


def sampling_params(args: argparse.Namespace, max_tokens: int | None = None):
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
