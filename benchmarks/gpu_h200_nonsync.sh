#!/usr/bin/env bash
# Steps without an event on the GPU, in about 7 minutes on an H200 (allow the whole script
# 10 minutes): does Streaming's step without an event come within 1% of
# plain's when XLA:GPU keeps the event loops on the device instead of reading each loop's
# predicate on the host?
#
#   bash benchmarks/gpu_h200_nonsync.sh [OUT_DIR]
#
# Two processes run the same `tools.benchmark --nonsync` measurement (the 100M model in
# bfloat16, K = 2 islands vmapped on the one device, plain, DiLoCo and Streaming V = 1 back
# to back in a rotating order, Streaming twice: as built by default, its exchange waiting
# for the inner step inside the one guard loop, and with the exchange free; 60 pairs each;
# then each mode through fragment 0's sync and apply,
# and three traced no-event steps per mode): first under XLA's default flags, then with while
# loops and conditionals recorded into the step's CUDA graphs (command buffers). Each has its
# own time limit and JSON, rewritten after each phase, so a stage cut short keeps what it
# measured. Both keep command buffers on under the profiler (XLA turns them off there by
# default, and the trace would show another program than the one timed); the trace's
# "graphs off" column says whether that held. `tools.compare_nonsync` then prints the runs
# side by side: each ratio with its verdict, the device-to-host copies per traced step (0
# once the loops stay on the device), and whether the events still ran, with the outer
# model's Σ|θ| against the first run. GRAPH_FLAGS replaces the second run's command-buffer
# flags: repeat +WHILE,+CONDITIONAL in it, e.g. if the reads remain:
#   GRAPH_FLAGS="--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL --xla_gpu_graph_min_graph_size=1"
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-${OUT:-.}}"
traces="${TRACE_DIR:-/tmp/diloco_eqx_traces}"  # raw traces: summarized in the JSONs, copied to OUT_DIR if small
mkdir -p "$out" "$traces"
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.9
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/gpu_nonsync.txt" 2>&1
python -c "import jax, jaxlib; print(jax.__version__, jaxlib.__version__, jax.devices())" >> "$out/gpu_nonsync.txt" 2>&1
cat "$out/gpu_nonsync.txt"
# SIZE, DTYPE, REPS and TRACE=no (no trace: XLA:CPU has no device timeline) let the slow test
# run the same script on a CPU, where XLA still parses the GPU flags
common=(--nonsync --sizes "${SIZE:-100M}" --dtype "${DTYPE:-bfloat16}" --reps "${REPS:-60}")
graphs="${GRAPH_FLAGS:---xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL}"
for run in default graphs; do
  rm -rf "$traces/$run" "$out/gpu_h200_nonsync_$run".*  # nothing of an earlier run passes for this one's
  flags="${XLA_FLAGS:-} --xla_enable_command_buffers_during_profiling=true"
  [ "$run" = graphs ] && flags="$flags $graphs"
  trace=(--trace "$traces/$run")
  [ "${TRACE:-yes}" = no ] && trace=()
  XLA_FLAGS="$flags" timeout -k 10 "${STAGE_LIMIT_S:-250}" python -m tools.benchmark "${common[@]}" "${trace[@]}" \
      --json "$out/gpu_h200_nonsync_$run.json" 2>&1 | tee "$out/gpu_h200_nonsync_$run.txt"
  status=${PIPESTATUS[0]}  # 124 or 137: the stage ran out of time
  echo "$run stage ended at ${SECONDS} s, exit status $status" | tee -a "$out/gpu_nonsync.txt"
  rm -f "$out"/*.part  # a JSON cut off mid-write (its previous phase's stands)
  # the newest raw trace, copied only when under 15 MiB so that each result file stays under 16 MiB
  newest=$(ls -t "$traces/$run"/*/plugins/profile/*/*.trace.json.gz 2>/dev/null | head -1)
  [ -n "$newest" ] && [ "$(stat -c %s "$newest")" -lt 15728640 ] && cp "$newest" "$out/gpu_h200_nonsync_$run.trace.json.gz"
done
python -m tools.compare_nonsync "$out/gpu_h200_nonsync_default.json" "$out/gpu_h200_nonsync_graphs.json" \
    2>&1 | tee "$out/gpu_h200_nonsync_compare.txt"
