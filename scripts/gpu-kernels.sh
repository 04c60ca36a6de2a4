#!/usr/bin/env bash
# Kernel tests (Triton compiled on CUDA, gpu-marked tests included) and the CUDA kernel benchmark.
# Usage: scripts/gpu-kernels.sh [python]   — needs torch with CUDA, triton, peft, transformers, pytest, hypothesis.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${1:-python}"
PYTHONPATH="$(bash scripts/namespace-path.sh)${PYTHONPATH:+:$PYTHONPATH}"  # the checkout's namespace: no install
export PYTHONPATH
"$PYTHON" -c 'import torch; assert torch.cuda.is_available(), "no CUDA device"; print(torch.cuda.get_device_name())'
"$PYTHON" -m pytest tests/kernels -q -p no:cacheprovider -o addopts=""
"$PYTHON" -m loraplane.cli bench kernels --quick --device cuda --json
