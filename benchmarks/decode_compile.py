"""Would compiling the decode step close the offline gap to vLLM (issue 38)? The second half of every decoder
block of a real model (residual add, norm, gate / up / down projections, silu, mul, residual add) for one
decode step's rows, two ways:

- eager, with the linears prepacked for oneDNN (`PackedLinear`, what the engine runs today);
- `torch.compile`d as one graph over all the layers (inductor with freezing: it packs the plain weights
  for oneDNN itself and fuses the element-wise ops between the matmuls).

    python benchmarks/decode_compile.py --model models/smollm2-135m --rows 4 64

Timing alternates the two in one process and reports medians (this machine's speed drifts by 20% over
minutes). The attention half is left out: the paged attention is not a torch op yet, so it would break the
graph.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time

import torch
import torch._inductor.config as inductor_config
from torch import nn

from shardforge.infer.packed import pack_linears
from shardforge.models.io import load_model


class MLPHalves(nn.Module):
    """h -> h after each block's `h + attn`, `h + mlp(post_attn_norm(h))`, over every layer."""

    def __init__(self, blocks: list[nn.Module]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)

    def forward(self, h: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            h = h + attn
            h = h + block.mlp(block.post_attn_norm(h))
        return h


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="an HF model folder")
    parser.add_argument("--rows", type=int, nargs="+", default=[4, 64], help="decode rows per step")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", default=None, help="write the rows here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    inductor_config.freezing = True
    model = load_model(args.model).eval()
    plain = MLPHalves(model.blocks())
    packed = copy.deepcopy(plain)
    pack_linears(packed)
    compiled = torch.compile(plain, dynamic=True)
    hidden = model.config.hidden_size
    print(f"{len(plain.blocks)} layers, hidden {hidden}, MLP {model.config.intermediate_size}\n")
    print(
        "| rows | eager packed (ms) | compiled (ms) | speedup | compiled vs packed | unpacked vs packed |"
        "\n|---|---|---|---|---|---|"
    )
    results = []
    with torch.no_grad():
        for rows in args.rows:
            h, attn = torch.randn(1, rows, hidden), 0.01 * torch.randn(1, rows, hidden)
            reference = packed(h, attn)
            # relative to the output's scale (the residual stream grows over the layers); compiles first
            difference = ((compiled(h, attn) - reference).abs().max() / reference.abs().max()).item()
            unpacked = ((plain(h, attn) - reference).abs().max() / reference.abs().max()).item()
            times: dict[str, list[float]] = {"eager": [], "compiled": []}
            for _ in range(args.repeats):
                for kind, fn in (("eager", packed), ("compiled", compiled)):
                    started = time.perf_counter()
                    fn(h, attn)
                    times[kind].append(time.perf_counter() - started)
            eager, comp = (statistics.median(times[k]) * 1e3 for k in ("eager", "compiled"))
            speed = f"| {rows} | {eager:.1f} | {comp:.1f} | {eager / comp:.2f}x"
            print(f"{speed} | {difference:.1e} | {unpacked:.1e} |", flush=True)
            results.append(
                {
                    "rows": rows,
                    "eager_ms": eager,
                    "compiled_ms": comp,
                    "relative_difference": difference,
                    "unpacked_relative_difference": unpacked,
                }
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
