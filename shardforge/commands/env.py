"""`shardforge env`: versions, threads, devices and the measured matmul peak, for bug reports."""

from __future__ import annotations

import argparse
import os
import platform

from rich.console import Console


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


def _has_backend(name: str) -> bool:
    import torch.distributed as dist

    return dist.is_available() and getattr(dist, f"is_{name}_available", lambda: False)()


def add_parser(sub: argparse._SubParsersAction) -> None:
    """`shardforge env`: the flags, and the handler as `func`."""
    p_env = sub.add_parser("env", help="versions, threads, devices and measured matmul peak")
    p_env.set_defaults(func=_cmd_env)
