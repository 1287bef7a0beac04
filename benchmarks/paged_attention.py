"""Decode attention over a paged KV cache, one layer, four ways (why infer/paged.py reads pool slices):

- batched: every sequence's blocks gathered into a padded batch, one SDPA call with a length mask (the
  engine's first design, from a blocks-first pool; and from the heads-first pool, as the engine now attends
  decodes whose keys are split over runs of blocks);
- per sequence, gathered: one SDPA call each on a gather of its own blocks (no padding, no mask);
- per sequence, sliced: one SDPA call each on a slice of a heads-first pool (its blocks in one run, as
  infer/blocks.py hands them out): no copy at all;
- the same, with the query heads of each key/value head folded into the query length.

    python benchmarks/paged_attention.py [--sequences 48 --keys 129 256 --heads 10 --kv-heads 5]

Every variant's output is checked against the batched one. Prints the median time per call of each.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F


def timed(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequences", type=int, default=48)
    parser.add_argument("--keys", type=int, nargs=2, default=(129, 256), help="key counts drawn from")
    parser.add_argument("--heads", type=int, default=10)
    parser.add_argument("--kv-heads", type=int, default=5)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", default=None, help="also write the rows here, as JSON")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    g, h, kvh, d, bs = args.sequences, args.heads, args.kv_heads, args.head_dim, args.block_size
    lengths = torch.randint(args.keys[0], args.keys[1] + 1, (g,)).tolist()
    per_seq = [-(-n // bs) for n in lengths]
    most = max(per_seq)
    num_blocks = 4 * sum(per_seq)
    # The same keys in both layouts: blocks-first [blocks, bs, kvh, d] and heads-first [1, kvh, slots, d].
    blocks_k = torch.randn(num_blocks, bs, kvh, d)
    blocks_v = torch.randn(num_blocks, bs, kvh, d)
    heads_k = blocks_k.permute(2, 0, 1, 3).reshape(1, kvh, -1, d).contiguous()
    heads_v = blocks_v.permute(2, 0, 1, 3).reshape(1, kvh, -1, d).contiguous()
    starts = [4 * sum(per_seq[:i]) for i in range(g)]  # each sequence's run of blocks, with gaps between
    table = torch.zeros(g, most, dtype=torch.long)
    for i, (s, n) in enumerate(zip(starts, per_seq, strict=True)):
        table[i, :n] = torch.arange(s, s + n)
    q = torch.randn(g, h, 1, d)
    mask = (torch.arange(most * bs)[None] < torch.tensor(lengths)[:, None])[:, None, None]

    def gather(pool: torch.Tensor) -> torch.Tensor:
        return pool.index_select(0, table.flatten()).view(g, -1, kvh, d).transpose(1, 2)

    def batched():
        return F.scaled_dot_product_attention(q, gather(blocks_k), gather(blocks_v), mask, enable_gqa=True)

    def batched_heads_first():
        """As infer/paged.py attends the decodes whose keys are split over runs of blocks."""

        def blocks(pool: torch.Tensor) -> torch.Tensor:
            return (
                pool.view(kvh, -1, bs * d)
                .index_select(1, table.flatten())
                .view(kvh, g, -1, d)
                .transpose(0, 1)
            )

        return F.scaled_dot_product_attention(q, blocks(heads_k), blocks(heads_v), mask, enable_gqa=True)

    def per_sequence_gathered():
        out = []
        for i, n in enumerate(lengths):
            k = blocks_k.index_select(0, table[i, : per_seq[i]]).view(-1, kvh, d)[:n].transpose(0, 1)[None]
            v = blocks_v.index_select(0, table[i, : per_seq[i]]).view(-1, kvh, d)[:n].transpose(0, 1)[None]
            out.append(F.scaled_dot_product_attention(q[i : i + 1], k, v, enable_gqa=True))
        return torch.cat(out)

    def per_sequence_sliced(fold: bool = False):
        """One SDPA call per sequence on slices of the heads-first pool; `fold` puts the query heads of each
        kv head into the query length instead of using SDPA's grouped-query support."""
        out = []
        for i, n in enumerate(lengths):
            a = starts[i] * bs
            k, v = heads_k[:, :, a : a + n], heads_v[:, :, a : a + n]
            if fold:
                folded = q[i : i + 1].view(1, kvh, h // kvh, d)
                out.append(F.scaled_dot_product_attention(folded, k, v).view(1, h, 1, d))
            else:
                out.append(F.scaled_dot_product_attention(q[i : i + 1], k, v, enable_gqa=True))
        return torch.cat(out)

    reference = batched()
    rows = []
    print(f"{g} sequences of {min(lengths)}-{max(lengths)} keys, {h} heads over {kvh} kv heads of {d}")
    print("| variant | ms per layer | max difference from batched |")
    print("|---|---|---|")
    for name, fn in (
        ("batched: gather + masked SDPA", batched),
        ("batched: blocks gathered from the heads-first pool + masked SDPA", batched_heads_first),
        ("per sequence, gathered", per_sequence_gathered),
        ("per sequence, pool slices", per_sequence_sliced),
        ("per sequence, slices, heads folded", lambda: per_sequence_sliced(fold=True)),
    ):
        diff = (fn() - reference).abs().max().item()
        assert diff < 1e-5, f"{name} differs from the batched attention by {diff}"
        ms = 1e3 * timed(fn, args.repeats)
        print(f"| {name} | {ms:.2f} | {diff:.1e} |")
        rows.append({"variant": name, "ms_per_layer": ms, "max_difference": diff})
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
