#!/usr/bin/env bash
# One prepared GPU check (benchmarks/gpu_check.py): install from a wheelhouse beside the machine's own torch,
# the versions and the device, the CUDA test tier (tests/cuda), bf16 training throughput and MFU of llama-1b
# (~0.98B parameters, rows of 2048) against the device's datasheet dense bf16 peak (989 TFLOP/s on an H200),
# the HF Trainer comparison in bf16, and the inference engine against transformers' generate. Each part is
# timed and printed as it ends; OUT/summary.json and OUT/summary.txt hold the results; the exit code is 1 if
# any part failed. It reaches no network, and fits in 10 minutes on one H200 (--budget, 570 s by default).
#
# On the GPU machine (Python 3.12 with its own CUDA torch), from a copy of the repo holding a wheelhouse built
# here with `bash scripts/wheelhouse.sh wheelhouse/ --python-version 3.12 --extras gpucheck`:
#
#   bash benchmarks/gpu_check.sh --wheelhouse wheelhouse --out "$OUT/gpu_check"
#
# On the CPU, a dry run of the whole script at tiny sizes (tests/e2e/test_gpu_check.py runs exactly this):
#
#   bash benchmarks/gpu_check.sh --device cpu --out runs/gpu_check_cpu
#
# Options: --device cuda|cpu, --out DIR (runs/gpu_check), --wheelhouse DIR, --python PY (default: the one
# running the script: $PYTHON, else .venv/bin/python where it exists, else python3), --budget SECONDS,
# --timeout-scale X (each part's limit times X), --peak-flops F (only for a GPU that planner/peak.py has no
# datasheet figure for).
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
PYTHON=${PYTHON:-$( [ -x "$HERE/../.venv/bin/python" ] && echo "$HERE/../.venv/bin/python" || echo python3 )}
exec "$PYTHON" "$HERE/gpu_check.py" --python "$PYTHON" "$@"
