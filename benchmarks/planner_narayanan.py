"""The planner on Narayanan et al. 2021 (arXiv 2104.04473) Table 1: GPT models of 1.7B to 1T parameters on
32 to 3072 A100-80s (2048-token rows), each with the paper's tensor / pipeline / data degrees and full
recompute, as Megatron ran them (data parallel read as ZeRO-2, one row per pipeline micro-batch, all of a
rank's rows in one micro-step). Per row: the estimated throughput of that layout in the paper's own FLOPs
formula (96 B s l h^2 (1 + s / 6h + V / 16lh), recompute included) against the reported one; where it ranks
among the layouts the search finds; and the best the search finds with the paper's degrees (checkpointing,
schedule and micro-batches its own), against the best overall.

    .venv/bin/python benchmarks/planner_narayanan.py [--out benchmarks/results_planner_narayanan.json]

Config.json folders only (no weights); about a minute on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from shardforge.config.schema import Config  # noqa: E402
from shardforge.models.build import check_model_source  # noqa: E402
from shardforge.planner.hardware import PRESETS, Cluster  # noqa: E402
from shardforge.planner.layout import layout_of  # noqa: E402
from shardforge.planner.search import Planner  # noqa: E402

SEQ, VOCAB = 2048, 51200
# name, heads, hidden, layers, tp, pp, GPUs, batch, reported teraFLOP/s per GPU (Table 1)
ROWS = [
    ("1.7B", 24, 2304, 24, 1, 1, 32, 512, 137),
    ("3.6B", 32, 3072, 30, 2, 1, 64, 512, 138),
    ("7.5B", 32, 4096, 36, 4, 1, 128, 512, 142),
    ("18.4B", 48, 6144, 40, 8, 1, 256, 1024, 135),
    ("39.1B", 64, 8192, 48, 8, 2, 512, 1536, 138),
    ("76.1B", 80, 10240, 60, 8, 4, 1024, 1792, 140),
    ("145.6B", 96, 12288, 80, 8, 8, 1536, 2304, 148),
    ("310.1B", 128, 16384, 96, 8, 16, 1920, 2160, 155),
    ("529.6B", 128, 20480, 105, 8, 35, 2520, 2520, 163),
    ("1008.0B", 160, 25600, 128, 8, 64, 3072, 3072, 163),
]


def paper_flops(batch: int, layers: int, h: int) -> float:
    """Narayanan et al.'s FLOPs per iteration, with activation recomputation (their equation 3)."""
    return 96 * batch * SEQ * layers * h * h * (1 + SEQ / (6 * h) + VOCAB / (16 * layers * h))


def row(folder: Path, name: str, heads: int, h: int, layers: int, tp: int, pp: int, gpus: int, batch: int,
        reported: float) -> dict:  # fmt: skip
    model = folder / name
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_act": "silu",
        "vocab_size": VOCAB, "hidden_size": h, "intermediate_size": 8 * h // 3 // 64 * 64,
        "num_attention_heads": heads, "num_key_value_heads": heads, "num_hidden_layers": layers,
        "rms_norm_eps": 1e-5, "max_position_embeddings": SEQ, "tie_word_embeddings": False,
    }))  # fmt: skip
    dp = gpus // (tp * pp)
    rows = batch // dp
    parallel = {"tp": tp, "pp": pp, "zero_stage": 2 if dp > 1 else 0, "dp_shard": dp,
                "activation_checkpoint": "full"} | ({"pp_microbatches": rows} if pp > 1 else {})  # fmt: skip
    nodes, per_node = max(1, gpus // 8), min(8, gpus)
    cfg = Config(
        model={"path": str(model)},
        data={"train": [{"path": "x.jsonl", "format": "alpaca"}], "max_length": SEQ},
        train={"precision": "bf16", "global_batch": batch, "micro_batch": rows if pp > 1 else 1},
        parallel=parallel,
        hardware={"preset": "a100-80", "nodes": nodes, "devices_per_node": per_node},
    )
    cluster = Cluster(PRESETS["a100-80"], nodes, per_node)
    planner = Planner(cfg, check_model_source(cfg.model, weights=False), cluster)
    published = planner.evaluate(layout_of(cfg, gpus))
    started = time.perf_counter()
    plan = planner.search(keep=10**9)
    seconds = time.perf_counter() - started
    best = plan.best
    same = next(c for c in plan.ranked if (c.layout.tp, c.layout.pp, c.layout.dp) == (tp, pp, dp))
    estimated = paper_flops(batch, layers, h) / published.time.total / gpus / 1e12
    return {
        "model": name,
        "published": published.layout.describe(),
        "fits": published.fits,
        "step_s": round(published.time.total, 2),
        "tflops_estimated": round(estimated, 1),
        "tflops_reported": reported,
        "estimated_over_reported": round(estimated / reported, 3),
        "rank": sum(c.time.total < published.time.total for c in plan.ranked) + 1,
        "searched_fit": len(plan.ranked),
        "best": best.layout.describe(),
        "best_step_s": round(best.time.total, 2),
        "published_over_best": round(published.time.total / best.time.total, 3),
        "same_degrees_best": same.layout.describe(),
        "same_degrees_over_best": round(same.time.total / best.time.total, 3),
        "search_s": round(seconds, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results_planner_narayanan.json")
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for spec in ROWS:
            r = row(Path(tmp), *spec)
            results.append(r)
            print(
                f"{r['model']:>8}: {r['published']} ({'fits' if r['fits'] else 'does not fit'}) "
                f"{r['step_s']} s, {r['tflops_estimated']} TFLOP/s a GPU (paper {r['tflops_reported']}); "
                f"rank {r['rank']}/{r['searched_fit']}, {r['published_over_best']}x the best "
                f"({r['best']}, {r['best_step_s']} s); paper's degrees {r['same_degrees_over_best']}x "
                f"({r['same_degrees_best']})",
                flush=True,
            )
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    within = sum(r["same_degrees_over_best"] <= 1.1 for r in results)
    print(f"paper's degrees within 10% of the best: {within} of {len(results)} rows; wrote {args.out}")


if __name__ == "__main__":
    main()
