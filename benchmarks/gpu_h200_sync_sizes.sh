#!/usr/bin/env bash
# The sync cost on the GPU at 10M and 30M: the vanilla sync's extra time against the fused
# pass over its bytes, for the 10M and 30M models in float32 (the CPU's measurement, the same
# command), K = 2 islands vmapped on the one device (gpu_h200.sh measures the 100M model in
# bfloat16). It takes about 5 minutes (allow it 10).
#
#   bash benchmarks/gpu_h200_sync_sizes.sh [OUT_DIR]
#
# One process per size, each with its own time limit and JSON (gpu_h200_sync_10M.json, ...),
# so a slow compile at 30M cannot cost the 10M figures. `paired.vanilla_extra_over_floor` in
# each JSON is the ratio with its 95% interval. SIZES, DTYPE and REPS let the slow
# test run the same script on a CPU.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-${OUT:-.}}"
mkdir -p "$out"
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.9
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/gpu_sync_sizes.txt" 2>&1
python -c "import jax, jaxlib; print(jax.__version__, jaxlib.__version__, jax.devices())" >> "$out/gpu_sync_sizes.txt" 2>&1
cat "$out/gpu_sync_sizes.txt"
for size in ${SIZES:-10M 30M}; do
  timeout -k 10 "${SIZE_LIMIT_S:-240}" python -m tools.benchmark --sync-cost-only --sizes "$size" \
      --dtype "${DTYPE:-float32}" --reps "${REPS:-40}" --json "$out/gpu_h200_sync_$size.json" \
      2>&1 | tee "$out/gpu_h200_sync_$size.txt"
  echo "$size ended at ${SECONDS} s, exit status ${PIPESTATUS[0]}" | tee -a "$out/gpu_sync_sizes.txt"
done
