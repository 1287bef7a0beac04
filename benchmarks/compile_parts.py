"""Is `torch.compile` worth it, part by part? Forward + backward of each element-wise part of a decoder block
(RMSNorm, SwiGLU, RoPE, the residual add) and of a whole block, eager against inductor-compiled, on a real
model's shapes, with each compile's cold time:

    python benchmarks/compile_parts.py --model models/smollm2-135m --rows 4 --seq 256

Timing alternates eager and compiled calls in one process (this machine's noise between runs is 5-10%) and
reports medians. `train.compile` compiles whole blocks; the per-part rows say where that gain comes from.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from shardforge.models.common.attention import AttentionContext
from shardforge.models.common.elementwise import apply_rope
from shardforge.models.io import load_model
from shardforge.models.llama.rope import rope_cos_sin


def _step(fn: Callable, inputs: list[torch.Tensor]) -> None:
    out = fn(*inputs)
    out.backward(torch.ones_like(out))


def measure(name: str, fn: Callable, make_inputs: Callable[[], list[torch.Tensor]], repeats: int) -> dict:
    compiled = torch.compile(fn)
    inputs = make_inputs()
    started = time.perf_counter()
    _step(compiled, inputs)  # the cold compile: graph capture, inductor, C++ build (or its cache)
    cold = time.perf_counter() - started
    _step(fn, inputs)
    times: dict[str, list[float]] = {"eager": [], "compiled": []}
    for _ in range(repeats):
        for kind, f in (("eager", fn), ("compiled", compiled)):
            inputs = make_inputs()
            started = time.perf_counter()
            _step(f, inputs)
            times[kind].append(time.perf_counter() - started)
    eager, comp = (statistics.median(times[k]) * 1e3 for k in ("eager", "compiled"))
    row = {"part": name, "eager_ms": eager, "compiled_ms": comp, "speedup": eager / comp, "cold_s": cold}
    print(
        f"| {name} | {eager:.2f} | {comp:.2f} | {eager / comp:.2f}x | {cold:.1f} |",
        flush=True,
    )
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="an HF model folder")
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", default=None, help="write the rows here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = load_model(args.model)
    cfg, block = model.config, model.blocks()[0]
    b, s, h = args.rows, args.seq, cfg.hidden_size
    positions = torch.arange(s).repeat(b, 1)
    cos, sin = rope_cos_sin(positions, model.inv_freq, torch.float32)
    ctx = AttentionContext()

    def leaf(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, requires_grad=True)

    def norm_block(x: torch.Tensor) -> torch.Tensor:
        return block.input_norm(x)

    def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return F.silu(gate) * up

    def rope(q: torch.Tensor) -> torch.Tensor:
        return apply_rope(q, cos, sin)

    def residual(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return x + y

    def whole_block(x: torch.Tensor) -> torch.Tensor:
        return block(x, cos, sin, ctx)

    print(f"{cfg.num_layers} layers, hidden {h}, MLP {cfg.intermediate_size}, {b} x {s} tokens, fwd + bwd\n")
    print("| part | eager (ms) | compiled (ms) | speedup | cold compile (s) |\n|---|---|---|---|---|")
    rows = [
        measure("RMSNorm", norm_block, lambda: [leaf(b, s, h)], args.repeats),
        measure(
            "SwiGLU (silu(gate) * up)",
            swiglu,
            lambda: [leaf(b, s, cfg.intermediate_size), leaf(b, s, cfg.intermediate_size)],
            args.repeats,
        ),
        measure("RoPE (on q)", rope, lambda: [leaf(b, cfg.num_heads, s, cfg.head_dim)], args.repeats),
        measure("residual add", residual, lambda: [leaf(b, s, h), leaf(b, s, h)], args.repeats),
        measure("whole block", whole_block, lambda: [leaf(b, s, h)], max(3, args.repeats // 4)),
    ]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
