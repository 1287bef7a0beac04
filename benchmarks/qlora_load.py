"""Host memory while a base model loads: in its dtype (bf16) against QLoRA's NF4 (model.quantize=nf4), each in
a fresh process, over the same HF folder (a ~220M-parameter Llama shape written once, in bf16).

    python benchmarks/qlora_load.py

Reports the peak anonymous RSS during the load (sampled every 5 ms from /proc: the pages the process owns; the
safetensors file's mapped pages are the page cache's, shared and dropped under pressure), the peak RSS as
the kernel counts it (with those mapped pages), the parameter bytes afterwards and the load time. torchao is
imported before the baseline in both processes (its import, ~40 MiB, is reported apart).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

_LOAD = r"""
import json, resource, sys, threading, time
import torch
from shardforge.models.io import load_model
from shardforge.parallel.memory import memory_report

def anon_kib():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1])

peak, done = [anon_kib()], []
def sample():
    while not done:
        peak.append(anon_kib())
        time.sleep(0.005)
start_anon = anon_kib()
import torchao.quantization.quantize_.workflows.nf4.nf4_tensor  # imported by NF4 loads: counted apart
before = anon_kib()
thread = threading.Thread(target=sample, daemon=True)
thread.start()
start = time.perf_counter()
model = load_model(sys.argv[1], dtype=torch.bfloat16, quantize=sys.argv[2] == "nf4")
seconds = time.perf_counter() - start
done.append(1)
thread.join()
print(json.dumps({
    "seconds": seconds,
    "peak_anon_growth_mib": (max(peak) - before) / 1024,
    "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    "param_mib": memory_report(model)["param_bytes"] / 2**20,
    "torchao_import_mib": (before - start_anon) / 1024,
}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--out", default=None, help="also write the JSON results here")
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    import torch

    from shardforge.models import save_model
    from shardforge.models.common.config import DecoderConfig
    from shardforge.models.llama.model import Decoder

    with tempfile.TemporaryDirectory() as tmp:
        cfg = DecoderConfig(
            vocab_size=32000,
            hidden_size=args.hidden,
            intermediate_size=args.hidden * 11 // 4,
            num_layers=args.layers,
            num_heads=args.hidden // 64,
            num_kv_heads=args.hidden // 64,
            head_dim=64,
        )
        with torch.device("meta"):
            model = Decoder(cfg)
        model.to_empty(device="cpu")
        model.init_weights(seed=0)
        folder = save_model(model.to(torch.bfloat16), Path(tmp) / "base", dtype=torch.bfloat16)
        params = sum(p.numel() for p in model.parameters())
        del model
        results = {}
        for quantize in ("none", "nf4"):
            proc = subprocess.run(
                [sys.executable, "-c", _LOAD, str(folder), quantize], capture_output=True, text=True, cwd=REPO
            )
            if proc.returncode:
                raise SystemExit(proc.stderr[-3000:])
            results[quantize] = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"model: {params / 1e6:.0f}M parameters, bf16 on disk")
    for quantize, r in results.items():
        growth, rss, held = r["peak_anon_growth_mib"], r["peak_rss_mib"], r["param_mib"]
        print(
            f"{quantize:5s} load {r['seconds']:5.1f} s  peak anonymous growth {growth:6.0f} MiB  "
            f"peak RSS {rss:6.0f} MiB  parameters {held:6.0f} MiB"
        )
    print(json.dumps(results, indent=1))
    if args.out:
        summary = {"hidden": args.hidden, "layers": args.layers, "parameters": params, **results}
        Path(args.out).write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main()
