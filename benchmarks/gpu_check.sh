#!/usr/bin/env bash
# One short GPU check (<= 5 minutes): Newton–Schulz throughput vs the bf16 matmul peak and
# single-GPU step latency of canzona.Muon vs torch.optim.Muon. Needs one CUDA device and a
# CUDA build of torch (>= 2.13) in the current environment.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q -e . --no-deps
timeout 300 python benchmarks/gpu_check.py "$@"
