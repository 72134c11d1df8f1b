#!/usr/bin/env bash
# The GPU benchmark, prepared for one run of a few minutes on a machine with one accelerator
# (written for an H200: jax with CUDA, equinox and optax installed, no network). It runs from
# the source tree and needs nothing else: drjax is only imported by drjax steps, grain and
# tensorboardX only by the training loop's data and trackers, and the model is plain jax.numpy.
#
#   bash benchmarks/gpu_h200.sh [OUT_DIR]
#
# What it measures, side by side in one process: a ~100M-parameter transformer (16 layers x
# 768 wide, 1024-token sequences, 16 per step) in bfloat16, K = 2 islands vmapped on the one
# device; the plain floor, DDP, DiLoCo (H = 100) and Streaming DiLoCo (P = 5, V = 1) step by
# step and amortized over H_eff; compile count, memory per mode, and model FLOP utilisation
# against a measured 8192x8192 bf16 matmul (gpu_h200.json). Then, in a second process, the
# sync's cost against the fused-copy floor for the same model (gpu_h200_sync.json). Each stage
# has its own time limit and JSON, so a slow compile in one cannot cost the other's results.
# Both take about 7 minutes on an H200 (the sync stage's limit is 180 s): allow the whole
# script 10 minutes.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-${OUT:-.}}"
mkdir -p "$out"
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.9
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv > "$out/gpu.txt" 2>&1
python -c "import jax, jaxlib, equinox, optax; print(jax.__version__, jaxlib.__version__, equinox.__version__, optax.__version__, jax.devices())" >> "$out/gpu.txt" 2>&1
cat "$out/gpu.txt"
common=(--sizes 100M --meshes none --dtype bfloat16 --backends shard_map)
timeout "${STEPS_LIMIT_S:-400}" python -m tools.benchmark "${common[@]}" --reps 10 --no-sync-cost \
    --json "$out/gpu_h200.json" 2>&1 | tee "$out/gpu_h200.txt"
echo "steps stage ended at ${SECONDS} s" | tee -a "$out/gpu.txt"
timeout "${SYNC_LIMIT_S:-180}" python -m tools.benchmark "${common[@]}" --reps 20 --sync-cost-only \
    --json "$out/gpu_h200_sync.json" 2>&1 | tee "$out/gpu_h200_sync.txt"
echo "sync stage ended at ${SECONDS} s" | tee -a "$out/gpu.txt"
