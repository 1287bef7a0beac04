#!/usr/bin/env bash
# The GPU variant of the benchmarks, for one H200 (or any CUDA GPU) when one is available: bf16 throughput and
# MFU of the single-process trainer on a ~300M model, then the HF Trainer comparison on CUDA. About 10 minutes.
# Not run by CI. MFU is against the H200's dense bf16 peak (989 TFLOP/s); pass PEAK=... for another GPU.
#
#   bash benchmarks/gpu_h200.sh [OUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/gpu_bench}
PEAK=${PEAK:-989e12}
mkdir -p "$OUT"
python -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name(0))"

# 1. Throughput and MFU: bf16 autocast, packed rows of 2048 tokens, 16 rows per step.
python benchmarks/single_process.py --device cuda --precision bf16 --preset llama-300m --micro-batch 16 \
    --seq 2048 --steps 40 --log-every 10 --peak-flops "$PEAK" | tee "$OUT/single_process.txt"

# 2. Side by side with transformers Trainer on the same GPU, bf16 (larger model and data than the CPU default).
python benchmarks/vs_hf_trainer.py --device cuda --precision bf16 --preset llama-300m --records 4000 \
    --batch 16 --lr 3e-4 --repeats 2 --out "$OUT/vs_hf_trainer.json" | tee "$OUT/vs_hf_trainer.txt"

# 3. Inference: the engine against transformers' generate (one at a time, padded batches) and its continuous
#    batching, on the ~50M model in bf16, then through the HTTP server under 32 streaming clients.
python benchmarks/inference.py --device cuda --dtype bfloat16 --size 50m --requests 256 --max-running 128 \
    --http 32 --out "$OUT/inference.json" | tee "$OUT/inference.txt"
