"""tools/compare_nonsync.py: verdicts on the 1% line worked out by hand, the event check,
two runs compared line by line, and (slow) the prepared GPU script run end to end on the CPU."""

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tools import compare_nonsync as C

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("low, high, expected", [
    (1.0031, 1.0076, "holding"),        # the whole interval below 1.01
    (1.0079, 1.0121, "unresolved"),     # across it
    (1.0101, 1.0300, "contradicted"),   # above it
    (1.0000, 1.0100, "unresolved"),     # touching the line is not below it
])
def test_verdict_on_the_one_percent_line(low, high, expected):
    assert C.verdict({"ratio_low": low, "ratio_high": high}) == expected


@pytest.mark.parametrize("spread, ran", [
    ([0.008, 0.0], True),            # vanilla: the sync at H applies at once
    ([0.008, 0.01, 0.0], True),      # V = 1: equal only after the apply, one step later
    ([0.008, 0.0, 0.0], False),      # equal a step early: not the schedule's apply
    ([0.008, 0.01, 1e-9], False),    # the apply did not make them equal
])
def test_events_ran_only_when_fragment_0_agrees_exactly_at_the_apply(spread, ran):
    assert C.events_ran({"fragment0_spread": spread}) is ran


@pytest.mark.parametrize("change, ran", [
    ([0.0, 0.0, 3e-4], True),       # the outer fragment 0 moves in the apply's step only
    ([0.0, 0.0, 0.0], False),       # never: the apply equalized the islands without a sync
    ([0.0, 3e-4, 3e-4], False),     # a step early too: not the schedule's sync
])
def test_events_ran_only_when_the_outer_fragment_0_moves_at_the_apply(change, ran):
    e = {"fragment0_spread": [0.008, 0.01, 0.0], "outer_fragment0_change": change}
    assert C.events_ran(e) is ran


def _run(jax_version: str = "0.11.2") -> dict:
    """A `--nonsync` JSON as `tools.benchmark` writes it: one size, DiLoCo and Streaming."""
    modes = {"diloco": (1.0054, 1.0031, 1.0076), "streaming": (1.0100, 1.0079, 1.0121)}
    return {"nonsync": {"100M": {"params": 114_451_200, "plain_s": 0.12001, "reps": 60, "modes": {
                m: {"median_s": 0.121, "ratio": r, "ratio_low": lo, "ratio_high": hi} for m, (r, lo, hi) in modes.items()}}},
            "settings": {"num_replicas": 2, "sync_period": 100, "num_fragments": 5, "overlap_steps": 1, "reps": 60},
            "machine": {"jax": jax_version, "xla_flags": "--xla_force_host_platform_device_count=8"},
            "dtype": "bfloat16"}


def test_a_run_against_a_second_run_with_command_buffers():
    """A run (DiLoCo 1.0054 [1.0031, 1.0076], Streaming 1.0100 [1.0079, 1.0121]) beside a
    second under command buffers whose Streaming interval lies below the line, with traced
    reads and event checks (Streaming's fragment 0 never agreeing: not run as scheduled);
    DiLoCo's Σ|θ| 200.5 against 200 is +2.50e-03."""
    first, second = _run(), _run()
    second["machine"]["xla_flags"] = ("--xla_force_host_platform_device_count=8 "
                                      "--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL")
    size = second["nonsync"]["100M"]
    size["modes"]["streaming"].update(ratio=1.004, ratio_low=1.002, ratio_high=1.006)
    size["trace"] = {"plain": {"d2h": 0, "span": 120_000.0}, "diloco": {"d2h": 0, "span": 120_100.0},
                     "streaming": {"d2h": 0, "span": 120_250.0, "graphs_off": 2}}
    events = {"diloco": {"fragment0_spread": [0.01, 0.0], "outer_abs_sum": 200.5},
              "streaming": {"fragment0_spread": [0.01, 0.02, 0.03], "outer_abs_sum": 300.0}}
    size["events"] = events
    first["nonsync"]["100M"]["events"] = copy.deepcopy(events)
    first["nonsync"]["100M"]["events"]["diloco"]["outer_abs_sum"] = 200.0
    lines = C.compare({"default": first, "graphs": second}).splitlines()
    assert lines[0] == "default: XLA flags (default); ?, jax 0.11.2"
    assert lines[1] == "graphs: XLA flags --xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL; ?, jax 0.11.2"
    assert lines[2] == "100M default: plain 120.01 ms, 60 pairs"
    assert lines[3].split(";")[0] == "  diloco         1.0054 [1.0031, 1.0076] holding at 1.01"
    assert lines[4].split(";")[0] == "  streaming      1.0100 [1.0079, 1.0121] unresolved at 1.01"
    assert lines[5].startswith("100M graphs: plain 120.")
    assert lines[6] == ("  diloco         1.0054 [1.0031, 1.0076] holding at 1.01; traced: 0 D2H, span − plain's "
                        "100 us; events ran, outer Σ|θ| ÷ first run's − 1 = +2.50e-03")
    assert lines[7] == ("  streaming      1.0040 [1.0020, 1.0060] holding at 1.01; traced: 0 D2H, span − plain's "
                        "250 us (command buffers off for the profiler: 2); events DID NOT RUN as scheduled, outer Σ|θ| ÷ first run's − 1 = +0.00e+00")


def test_a_failed_trace_is_named_beside_the_ratio():
    run = _run()
    run["nonsync"]["100M"]["trace_error"] = "RuntimeError: CUPTI went away"
    lines = C.compare({"graphs": run}).splitlines()
    assert lines[2] == "  diloco         1.0054 [1.0031, 1.0076] holding at 1.01; trace failed: RuntimeError: CUPTI went away"


def test_a_json_of_another_section_is_refused_by_name(tmp_path):
    (tmp_path / "steps.json").write_text(json.dumps({"rows": [], "memory": {}, "settings": {}}))
    (tmp_path / "nonsync.json").write_text(json.dumps(_run()))
    with pytest.raises(SystemExit, match=r"steps\.json is not a `tools.benchmark --nonsync` JSON"):
        C.main([str(tmp_path / "steps.json"), str(tmp_path / "nonsync.json")])
    with pytest.raises(SystemExit, match="cannot read"):
        C.main([str(tmp_path / "absent.json")])


def test_a_run_that_left_no_json_is_named_and_the_others_compared(tmp_path, capsys):
    (tmp_path / "gpu_h200_nonsync.json").write_text(json.dumps(_run()))
    text = C.main([str(tmp_path / "graphs.json"), str(tmp_path / "gpu_h200_nonsync.json")])
    lines = text.splitlines()
    assert lines[0].startswith(f"compare_nonsync: cannot read {tmp_path / 'graphs.json'}") and \
        lines[0].endswith("(not compared)")
    assert lines[1] == "gpu_h200_nonsync: XLA flags (default); ?, jax 0.11.2"
    assert lines[3].split(";")[0] == "  diloco         1.0054 [1.0031, 1.0076] holding at 1.01"
    assert capsys.readouterr().out == text + "\n"


@pytest.mark.slow
def test_the_prepared_gpu_script_runs_on_the_cpu(tmp_path):
    """benchmarks/gpu_h200_nonsync.sh with the 1M model in float32, 2 pairs and no trace: both
    runs write their JSON (the second under the command-buffer flag, which XLA parses on a
    CPU too), every event runs as scheduled in both (the outer fragment 0 moving in the
    apply's step only), and both give the same outer model."""
    env = {**os.environ, "SIZE": "1M", "DTYPE": "float32", "REPS": "2", "TRACE": "no", "XLA_FLAGS": "",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}  # the script's `python`
    done = subprocess.run(["bash", "benchmarks/gpu_h200_nonsync.sh", str(tmp_path)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    runs = {r: json.loads((tmp_path / f"gpu_h200_nonsync_{r}.json").read_text()) for r in ("default", "graphs")}
    assert "--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL" in runs["graphs"]["machine"]["xla_flags"]
    assert "--xla_gpu_enable_command_buffer" not in runs["default"]["machine"]["xla_flags"]
    # both keep command buffers on under the profiler, so their traces show the timed program
    assert all("--xla_enable_command_buffers_during_profiling=true" in r["machine"]["xla_flags"]
               for r in runs.values())
    for r in runs.values():
        events = r["nonsync"]["1M"]["events"]
        assert events["diloco"]["ends"] == [99, 100]
        assert events["streaming"]["ends"] == events["streaming_free"]["ends"] == [99, 100, 101]
        assert all(C.events_ran(e) and "outer_fragment0_change" in e for e in events.values())
    assert {m: e["outer_abs_sum"] for m, e in runs["graphs"]["nonsync"]["1M"]["events"].items()} == \
        {m: e["outer_abs_sum"] for m, e in runs["default"]["nonsync"]["1M"]["events"].items()}
    text = (tmp_path / "gpu_h200_nonsync_compare.txt").read_text()
    assert text.count("events ran") == 6 and "DID NOT RUN" not in text  # 3 modes, 2 runs
