#!/usr/bin/env bash
# The GPU benchmark, prepared for one run of a few minutes on a machine with one accelerator
# (written for an H200: jax with CUDA, equinox and optax installed, no network). It runs from
# the source tree and needs nothing else: drjax is only imported by drjax steps, and the model
# is plain jax.numpy.
#
#   bash benchmarks/gpu_h200.sh [OUT_DIR]
#
# What it measures, side by side in one process: a ~100M-parameter transformer (14 layers x
# 768 wide, 1024-token sequences, 16 per step) in bfloat16, K = 2 islands vmapped on the one
# device; the plain floor, DDP, DiLoCo (H = 100) and Streaming DiLoCo (P = 5, V = 1) step by
# step and amortized over H_eff; compile count, memory per mode, the sync's cost against the
# fused-copy floor, and model FLOP utilisation against a measured 8192x8192 bf16 matmul.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-${OUT:-.}}"
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/gpu.txt" 2>&1 || true
PYTHONPATH=. XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 python -m tools.benchmark \
    --sizes 100M --meshes none --dtype bfloat16 --backends shard_map --reps 10 \
    --json "$out/gpu_h200.json" 2>&1 | tee "$out/gpu_h200.txt"
