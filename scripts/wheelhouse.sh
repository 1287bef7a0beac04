#!/usr/bin/env bash
# A folder of wheels for every dependency of shardforge except torch, for installing with no package index
# beside a torch that is already there (a cluster's or a GPU image's own CUDA build). README: "Supported
# versions, and installing beside your own torch".
#
#   bash scripts/wheelhouse.sh wheelhouse/                                   # for this Python and platform
#   bash scripts/wheelhouse.sh wheelhouse/ --python-version 3.12 --extras gpucheck \
#       --exclude numpy,pyarrow,matplotlib,tensorboard,pillow                 # for a Python 3.12 GPU image
#
# then, on the target:
#   python -m pip install --no-index --find-links wheelhouse/ -c wheelhouse/constraints.txt shardforge
#
# Needs this machine's package index and a Python with pip and `packaging` (the project's .venv has both).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
exec "$PYTHON" scripts/wheelhouse.py "$@"
