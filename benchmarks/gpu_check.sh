#!/usr/bin/env bash
# One short GPU check (<= 10 minutes): Newton–Schulz throughput vs the bf16 matmul peak,
# single-GPU step latency of canzona.Muon vs torch.optim.Muon, the host cost per matrix; cost
# tables of Qwen3 models timed on the GPU (for benchmarks/device_plans.py); then the GPU
# tests. Needs one CUDA device and a CUDA build of torch in the current environment.
# Runs from the source tree (no install: a GPU image may have no network); PYTHON picks the
# interpreter (default python3).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
timeout 300 "$PYTHON" benchmarks/gpu_check.py "$@"
# canzona calibrate on this device, one table per model, split and world size, each shape
# timed on the stack an owner of that world's plan forms (CANZONA_TABLES: where). The budget
# is a bound, not what it takes (seconds here): a shape is skipped (fitted) when its call,
# predicted at the highest seconds per FLOP timed so far, exceeds a quarter of it, and the
# launch-bound head blocks, timed first, predict the MLP matrices ~200x too slow.
TABLES="${CANZONA_TABLES:-benchmarks/results/device_costs}"
mkdir -p "$TABLES"
for case in qwen3-32b:heads qwen3-32b:qkv qwen3-30b-a3b:qkv; do
    model="${case%%:*}" split="${case##*:}"
    for world in 8 64 256; do
        timeout 120 "$PYTHON" -m canzona.cli calibrate --model "$model" --split "$split" \
            --world "$world" --device cuda --budget 600 --out "$TABLES/${model}__${split}__w${world}.json"
    done
done
# The GPU tests: canzona.Muon on CUDA against torch, state on the device, the host syncs of a
# step (one device and two ranks sharing it), CUDA-event calibration, the NCCL path.
if "$PYTHON" -c "import pytest" 2>/dev/null; then
    timeout 240 "$PYTHON" -m pytest -q -s -p no:cacheprovider tests/runtime/test_gpu.py
else
    echo "pytest is not installed here: tests/runtime/test_gpu.py not run"
fi
