"""An MoE layer's experts, forward + backward, two ways (why models/moe.py runs grouped matmuls):

- loop: a Python loop over the experts, each running its rows through its own weights (`unbind` / `split`,
  the fastest loop form: indexing `W[e]` materializes a whole [E, ...] gradient per expert);
- grouped: the rows sorted by expert through two `F.grouped_mm` calls (our `Experts`).

    python benchmarks/moe_experts.py [--experts 8 64 --tokens 512 --hidden 64 --width 128 --top-k 2]

Both are checked to give the same output and gradients. Prints the median milliseconds per step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from shardforge.models.moe import Experts, MoEShape, Router, sort_by_expert


def timed(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def loop_experts(experts: Experts, x: torch.Tensor, dispatch) -> torch.Tensor:
    rows = x[dispatch.token]
    outputs = []
    for part, gate_up, down in zip(
        rows.split(dispatch.counts.tolist()),
        experts.gate_up_proj.unbind(0),
        experts.down_proj.unbind(0),
        strict=True,
    ):
        gate, up = F.linear(part, gate_up).chunk(2, dim=-1)
        outputs.append(F.linear(F.silu(gate) * up, down))
    out = torch.cat(outputs) * dispatch.weights[:, None]
    return torch.zeros_like(x).index_add_(0, dispatch.token, out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", default=None, help="also write the rows here, as JSON")
    args = parser.parse_args()
    rows = []
    print(
        f"threads {torch.get_num_threads()}, {args.tokens} tokens, hidden {args.hidden}, width {args.width}"
    )
    for count in args.experts:
        torch.manual_seed(0)
        shape = MoEShape(args.hidden, args.width, count, args.top_k, True)
        router, experts = Router(shape), Experts(shape)
        for p in (router.weight, experts.gate_up_proj, experts.down_proj):
            torch.nn.init.normal_(p, std=0.1)
        x = torch.randn(args.tokens, args.hidden)
        with torch.no_grad():  # the experts alone are timed: fixed routing
            dispatch = sort_by_expert(router(x), count)
        probe = torch.randn_like(x)
        results = {}
        for name, run in (("loop", loop_experts), ("grouped", lambda e, x, d: e(x, d))):

            def step(run=run, experts=experts, x=x, dispatch=dispatch, probe=probe):
                experts.zero_grad()
                (run(experts, x, dispatch) * probe).sum().backward()

            step()
            results[name] = (experts.gate_up_proj.grad.clone(), timed(step, args.repeats))
        torch.testing.assert_close(results["loop"][0], results["grouped"][0], rtol=1e-5, atol=1e-6)
        loop_ms, grouped_ms = results["loop"][1], results["grouped"][1]
        empty = int((dispatch.counts == 0).sum())
        print(
            f"E={count:3d} ({empty} without a token): loop {loop_ms:6.2f} ms, grouped {grouped_ms:6.2f} ms "
            f"({loop_ms / grouped_ms:.2f}x)"
        )
        rows.append(
            {
                "experts": count,
                "threads": torch.get_num_threads(),
                "tokens": args.tokens,
                "hidden": args.hidden,
                "width": args.width,
                "top_k": args.top_k,
                "loop_ms": loop_ms,
                "grouped_ms": grouped_ms,
                "loop_over_grouped": loop_ms / grouped_ms,
            }
        )
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
