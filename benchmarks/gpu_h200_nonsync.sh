#!/usr/bin/env bash
# Target 3 on the GPU, prepared for one device call of about 6 minutes (give it 9): does
# Streaming's step without an event come within 1% of plain's when XLA:GPU keeps the event
# loops on the device instead of reading each loop's predicate on the host?
#
#   bash benchmarks/gpu_h200_nonsync.sh [OUT_DIR]
#
# Two processes run the same `tools.benchmark --nonsync` measurement (the 100M model in
# bfloat16, K = 2 islands vmapped on the one device, plain, DiLoCo and Streaming V = 1 back
# to back in a rotating order, 80 pairs; then each mode through fragment 0's sync and apply,
# and three traced no-event steps per mode): first under XLA's default flags, then with while
# loops and conditionals recorded into the step's CUDA graphs (command buffers). Each has its
# own time limit and JSON. `tools.compare_nonsync` then prints them side by side: each ratio
# with its verdict, the device-to-host copies per traced step (0 once the loops stay on the
# device), and whether the events still ran, with the outer model's Σ|θ| against the first run.
# GRAPH_FLAGS replaces the second run's flags (e.g. adding --xla_gpu_graph_min_graph_size=1 if
# the reads remain).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-${OUT:-.}}"
traces="${TRACE_DIR:-/tmp/diloco_eqx_traces}"  # the raw traces stay out of OUT_DIR: the JSONs hold their summaries
mkdir -p "$out" "$traces"
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.9
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/gpu_nonsync.txt" 2>&1
python -c "import jax, jaxlib; print(jax.__version__, jaxlib.__version__, jax.devices())" >> "$out/gpu_nonsync.txt" 2>&1
cat "$out/gpu_nonsync.txt"
# SIZE, DTYPE, REPS and TRACE=no (no trace: XLA:CPU has no device timeline) let the slow test
# run the same script on a CPU, where XLA still parses the GPU flag
common=(--nonsync --sizes "${SIZE:-100M}" --dtype "${DTYPE:-bfloat16}" --reps "${REPS:-80}")
graphs="${GRAPH_FLAGS:---xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL}"  # GRAPH_FLAGS: other flags for the second run
for run in default graphs; do
  flags="${XLA_FLAGS:-}"
  [ "$run" = graphs ] && flags="$flags $graphs"
  trace=(--trace "$traces/$run")
  [ "${TRACE:-yes}" = no ] && trace=()
  XLA_FLAGS="$flags" timeout "${STAGE_LIMIT_S:-270}" python -m tools.benchmark "${common[@]}" "${trace[@]}" \
      --json "$out/gpu_h200_nonsync_$run.json" 2>&1 | tee "$out/gpu_h200_nonsync_$run.txt"
  echo "$run stage ended at ${SECONDS} s" | tee -a "$out/gpu_nonsync.txt"
done
python -m tools.compare_nonsync "$out/gpu_h200_nonsync_default.json" "$out/gpu_h200_nonsync_graphs.json" \
    2>&1 | tee "$out/gpu_h200_nonsync_compare.txt"
