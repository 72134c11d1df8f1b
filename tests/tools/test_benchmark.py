"""tools.benchmark: its flag checks and summaries on hand-made times, and (slow) each section
run on the 1M model, its JSON checked against the formulas it reports against and the
invariants of paired statistics. Runs go through a subprocess with XLA's normal optimization
(the test suite's quick-compile mode would make the timed steps meaninglessly slow)."""

import functools
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def benchmark_json(tmp_path, *flags: str, timeout: int = 900) -> dict:
    """The JSON `tools.benchmark` writes with `flags`, run with XLA's normal optimization."""
    path = tmp_path / "bench.json"
    subprocess.run([sys.executable, "-m", "tools.benchmark", *flags, "--json", str(path)], cwd=ROOT,
                   env={**os.environ, "XLA_FLAGS": ""}, check=True, capture_output=True, timeout=timeout)
    return json.loads(path.read_text())


@pytest.mark.slow
def test_quick_benchmark_json(tmp_path):
    check_quick_json(benchmark_json(tmp_path, "--quick", "--reps", "5", timeout=1800))


def check_quick_json(result: dict) -> None:
    """What the quick JSON must hold."""
    assert result["compilations"] == 1
    mem = result["memory"]
    assert mem["diloco_bytes"] > mem["plain_bytes"] > 0
    for name, m in mem["modes"].items():  # every mode's extra memory within 5% of its formula
        assert abs(m["extra_bytes"] / m["expected_extra_bytes"] - 1) < 0.05, (name, m)
        # and at the peak, before the allocator's layout, what it holds is the formula's
        assert abs(m["live_extra_bytes"] / m["expected_extra_bytes"] - 1) < 0.001, (name, m)
    assert mem["modes"]["vanilla"]["expected_extra_bytes"] == 2 * mem["param_bytes"]
    assert mem["modes"]["streaming"]["expected_extra_bytes"] == 2 * mem["param_bytes"]
    # the stash holds the largest fragment of each of the K = 2 islands, not the model
    assert (mem["modes"]["streaming_deferred"]["expected_extra_bytes"]
            == 2 * mem["param_bytes"] + 2 * mem["largest_fragment_bytes"])
    assert mem["largest_fragment_bytes"] < mem["param_bytes"] / 3
    low = mem["bfloat16"]  # the outer side stays float32: b_outer = 4 whatever the islands use
    assert abs(low["extra_bytes"] / low["expected_extra_bytes"] - 1) < 0.10
    assert low["expected_extra_bytes"] == 2 * low["params"] * 4
    assert set(mem["modes"]) == {f"{m}{b}" for m in ("vanilla", "streaming", "streaming_deferred")
                                 for b in ("", "_drjax")}
    size = result["sizes"]["1M/none"]  # model FLOPs by hand: 6·|Θ| + 12·layers·width·seq_len a token
    n, plain = size["params"], next(r["median_s"] for r in result["rows"] if (r["mode"], r["phase"]) == ("plain", "step"))
    assert size["model_flops_per_step"] == 16 * 128 * (6 * n + 12 * 4 * 128 * 128)
    assert size["model_flops_utilisation"] == pytest.approx(size["model_flops_per_step"] / plain
                                                             / size["matmul_flops_per_s"])
    cost = result["sync_cost"]["1M"]  # measured against the floor of the bytes a sync touches
    assert cost["floor_s"] > 0 and cost["floor_bytes"] == 2 * (2 + 2) * cost["params"] * 4
    assert cost["vanilla_extra_over_floor"] == pytest.approx(cost["vanilla_sync_extra_s"] / cost["floor_s"])
    # the same sync written by hand, timed in the same run, can take no less than the floor
    assert cost["handwritten_sync_s"] > 0.5 * cost["floor_s"]
    assert cost["vanilla_extra_over_handwritten"] == pytest.approx(cost["vanilla_sync_extra_s"] / cost["handwritten_sync_s"])
    # and its arithmetic alone, without the two norms: no pass can beat the floor either
    assert cost["minimal_sync_s"] > 0.5 * cost["floor_s"]
    assert cost["minimal_over_floor"] == pytest.approx(cost["minimal_sync_s"] / cost["floor_s"])
    # the same ratios paired within each repetition, with their intervals
    assert set(cost["paired"]) == {"vanilla_extra_over_floor", "handwritten_over_floor", "minimal_over_floor",
                                   "vanilla_extra_over_handwritten"}
    assert all(r["low"] <= r["mean"] <= r["high"] for r in cost["paired"].values())
    assert cost["paired"]["minimal_over_floor"]["low"] > 0.5
    assert cost["stash_extra_s"] + cost["exchange_apply_extra_s"] == pytest.approx(cost["streaming_sync_extra_s"])
    assert cost["one_over_p"] == 1 / result["settings"]["num_fragments"]
    for mode in ("diloco", "streaming"):  # non-sync steps over plain, paired, with an interval
        r = cost[f"{mode}_nonsync_ratio"]
        assert 0 < r["low"] <= r["mean"] <= r["high"], (mode, r)
    # every fragment's sync timed equally often; the cycle's mean is of the per-fragment costs
    per = cost["streaming_per_fragment"]
    assert [p["fragment"] for p in per] == list(range(result["settings"]["num_fragments"]))
    assert {p["reps"] for p in per} == {cost["reps"] // len(per)} and cost["reps"] % len(per) == 0
    assert sum(p["param_fraction"] for p in per) == pytest.approx(1.0)
    cycle = sum(p["stash_extra_s"] + p["exchange_apply_extra_s"] for p in per) / len(per)
    assert cost["streaming_cycle_extra_s"] == pytest.approx(cycle)
    assert cost["streaming_cycle_over_vanilla"] == pytest.approx(cycle / cost["vanilla_sync_extra_s"])
    # a deferred sync's own floor: 3·K·4 + 2·K·4 + 6·4 bytes a parameter over P syncs, against
    # vanilla's 2·K·4 + 4·4: 64 / (5·32) = 0.4 for K = 2, P = 5 in float32
    p = result["settings"]["num_fragments"]
    assert cost["streaming_floor_bytes"] == (3 * 2 * 4 + 2 * 2 * 4 + 6 * 4) * cost["params"] // p
    assert cost["streaming_floor_over_vanilla_floor"] == pytest.approx(64 / (p * 32), rel=1e-6)
    assert cost["streaming_cycle_over_floor"] == pytest.approx(cycle / cost["streaming_floor_s"])
    for p in per:
        assert p["over_vanilla"] == pytest.approx((p["stash_extra_s"] + p["exchange_apply_extra_s"])
                                                  / cost["vanilla_sync_extra_s"])
    # Streaming with V = 0 in the same repetitions: its one sync-and-apply step per fragment
    v0 = cost["streaming_v0_per_fragment"]
    assert [(q["fragment"], q["layers"], q["reps"]) for q in v0] == [(q["fragment"], q["layers"], q["reps"]) for q in per]
    assert cost["streaming_v0_cycle_extra_s"] == pytest.approx(sum(q["sync_apply_extra_s"] for q in v0) / len(v0))
    paired = cost["cycle_over_vanilla_paired"]
    assert set(paired) == {"streaming", "streaming_v0"}
    for r in paired.values():
        assert r["cycles"] == cost["reps"] // len(per) and r["low"] <= r["mean"] <= r["high"]
    phases = {(r["mode"], r["phase"]) for r in result["rows"]}
    for mode in ("diloco", "streaming", "diloco_drjax", "streaming_drjax"):  # both backends
        assert {(mode, p) for p in ("nonsync", "sync", "amortized")} <= phases
        assert result["compile"][f"1M/none/{mode}"]["count"] == 1
    assert ("streaming", "apply") in phases and ("plain", "step") in phases
    for r in result["rows"]:
        assert set(r) >= {"size", "mode", "phase", "median_s", "ratio_to_plain"}
        assert r["median_s"] > 0 and r["size"] == "1M"
        if r["phase"] != "amortized":  # each repetition's time over plain's in the same repetition
            assert r["paired_ratio_low"] <= r["paired_ratio"] <= r["paired_ratio_high"], r


@pytest.mark.slow
def test_the_prepared_gpu_sync_sizes_script_runs_on_the_cpu(tmp_path):
    """benchmarks/gpu_h200_sync_sizes.sh (the sync cost at 10M and 30M) with the 1M model
    and 2 repetitions: one JSON per size, in float32, whose floor reads and writes the K + 2
    float32 buffers of K = 2 islands, the outer model and its trace."""
    env = {**os.environ, "SIZES": "1M", "REPS": "2", "XLA_FLAGS": "",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}  # the script's `python`
    done = subprocess.run(["bash", "benchmarks/gpu_h200_sync_sizes.sh", str(tmp_path)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and "1M ended at" in done.stdout, done.stderr[-2000:]
    result = json.loads((tmp_path / "gpu_h200_sync_1M.json").read_text())
    assert result["dtype"] == "float32" and set(result["sync_cost"]) == {"1M"}
    c = result["sync_cost"]["1M"]
    assert c["floor_bytes"] == 2 * (2 + 2) * 4 * c["params"]
    ratio = c["paired"]["vanilla_extra_over_floor"]
    assert ratio["low"] <= ratio["mean"] <= ratio["high"]


def check_nonsync_json(result: dict) -> None:
    """What a `--nonsync` JSON must hold: per size, DiLoCo's and Streaming's (exchange waiting
    and free) full-batch steps without an event over plain's, as paired ratios with their
    intervals; and the event check: fragment 0's sync at H_eff = 100 and its apply (V = 0 for
    DiLoCo, 1 for Streaming) make the islands' fragment 0 exactly equal after the apply and
    not before, and move the outer fragment 0 in the apply's step only."""
    for size, c in result["nonsync"].items():
        assert set(c["modes"]) == {"diloco", "streaming", "streaming_free"}
        assert c["plain_s"] > 0
        for mode, r in c["modes"].items():
            # a t-interval over a few noisy pairs may reach below 0; the mean may not
            assert r["ratio_low"] <= r["ratio"] <= r["ratio_high"] and r["ratio"] > 0, (size, mode, r)
            assert r["median_s"] > 0
        assert set(c["events"]) == set(c["modes"])
        for mode, e in c["events"].items():
            applied = {"diloco": 100, "streaming": 101, "streaming_free": 101}[mode]
            assert e["ends"] == list(range(99, applied + 1)) and e["applied_at"] == applied, (size, mode, e)
            assert e["fragment0_spread"][-1] == 0 and min(e["fragment0_spread"][:-1]) > 0, (size, mode, e)
            *still, moved = e["outer_fragment0_change"]
            assert moved > 0 and still == [0.0] * len(still), (size, mode, e)
            assert e["outer_abs_sum"] > 0


@pytest.mark.parametrize("flags, message", [
    (["--trace", "t"], "--trace: only with --nonsync"),
    (["--nonsync", "--trace", "t"], "--trace: needs an accelerator"),
    (["--nonsync", "--fragment-order", "sequential", "--json", "t"], "--fragment-order: only with --sync-cost-only"),
    (["--sync-cost-only", "--fragment-order", "reversed", "--json", "t"],
     "--fragment-order: fragment_order must be one of ('interleaved', 'sequential')"),
    (["--compare-order", "sequential", "--json", "t"], "--compare-order: only with --sync-cost-only"),
    (["--delayed-outer", "eager", "--json", "t"], "--delayed-outer: only with --sync-cost-only"),
    (["--sync-cost-only", "--delayed-outer", "lazy", "--json", "t"], "--delayed-outer: invalid choice: 'lazy'"),
    (["--sync-cost-only", "--compare-order", "interleaved", "--json", "t"],
     "--compare-order: 'interleaved' is --fragment-order's own"),
    (["--sync-cost-only", "--compare-order", "reversed", "--json", "t"],
     "--compare-order: fragment_order must be one of ('interleaved', 'sequential')"),
])
def test_bad_flags_are_refused_before_anything_runs(tmp_path, flags, message):
    """Before any model is built or file written: --trace without --nonsync, or on CPU (the
    subprocess is held to CPU, so the test says the same on a machine with an accelerator);
    a fragment order for a section that times only the default, or one not registered; an
    order to compare outside the sync-cost section, or the same order twice."""
    run = subprocess.run([sys.executable, "-m", "tools.benchmark", *flags, "--sizes", "1M"], cwd=tmp_path,
                         env={**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"},
                         capture_output=True, text=True, timeout=120)
    assert run.returncode != 0 and message in run.stderr and not (tmp_path / "t").exists()


def test_the_step_tables_phases_end_on_their_events():
    """Where the step table's timed steps end, by hand for H = 100, P = 5, V = 1 (Δh = 20),
    and against the schedule: a Streaming sync of every fragment once, each apply one step
    after its sync, the vanilla sync at H, and no event at all on the non-sync steps."""
    import diloco_eqx as dl
    from tools.bench.table import phase_jobs

    vanilla, streaming = dl.Schedule(100), dl.Schedule(100, 5, 1)
    jobs = phase_jobs(vanilla, streaming, ("shard_map", "drjax"), 5)
    assert jobs[("plain", "step")] == jobs[("ddp", "step")] == [None]
    for suffix in ("", "_drjax"):
        syncs, applies = jobs[(f"streaming{suffix}", "sync")], jobs[(f"streaming{suffix}", "apply")]
        assert syncs == [20, 40, 60, 80, 100] and applies == [21, 41, 61, 81, 101]
        assert [streaming.sync_fragment(t) for t in syncs] == [1, 2, 3, 4, 0]
        assert [streaming.apply_fragment(t) for t in applies] == [1, 2, 3, 4, 0]
        assert jobs[(f"diloco{suffix}", "sync")] == [100] and vanilla.is_sync(100)
        for mode, schedule in ((f"diloco{suffix}", vanilla), (f"streaming{suffix}", streaming)):
            (t,) = jobs[(mode, "nonsync")]
            assert not schedule.is_sync(t) and not schedule.is_apply(t)


def _commands(markdown: str) -> list[list[str]]:
    """The command lines of a markdown text's bash code blocks, as argument lists."""
    import shlex

    blocks = re.findall(r"```bash\n(.*?)```", markdown, flags=re.S)
    lines = [line for block in blocks for line in block.replace("\\\n", " ").splitlines()]
    return [words for line in lines if (words := shlex.split(line, comments=True))]


def test_every_result_in_benchmarks_has_its_command_in_the_readme():
    """Each JSON in benchmarks/ is written by a command of benchmarks/README.md: `--json` of a
    `tools` command, the soak's default, or a prepared script run there (every `.txt` is the
    output beside a JSON); and every `tools.benchmark` command there and in the main README
    passes the flag checks as written (a renamed or refused flag would fail here, not in a
    user's run)."""
    from tools import soak
    from tools.benchmark import parse_args

    written = set()
    for words in _commands((ROOT / "benchmarks" / "README.md").read_text()):
        if words[0] == "bash":
            written |= set(re.findall(r"(\w+)\.json", (ROOT / words[1]).read_text()))
            continue
        assert words[:2] == ["python", "-m"], words
        if words[2] == "tools.benchmark":
            parse_args(words[3:])
        json_path = words[words.index("--json") + 1] if "--json" in words else (
            str(soak.build_parser().parse_args([]).json) if words[2] == "tools.soak" else None)
        assert json_path is not None, words
        written.add(Path(json_path).name.removesuffix(".json"))
    results = {p.stem for p in (ROOT / "benchmarks").glob("*.json")}
    assert results <= written, sorted(results - written)
    assert {p.stem for p in (ROOT / "benchmarks").glob("*.txt")} <= results
    for words in _commands((ROOT / "README.md").read_text()):
        if words[:3] == ["python", "-m", "tools.benchmark"]:
            parse_args(words[3:])


@pytest.mark.parametrize("streaming, want", [
    # P = 2, consecutive pairs: (1+1)/8, (2+2)/8, (1+3)/8 = 0.25, 0.5, 0.5; t(0.975, 2) = 4.302653,
    # s = 0.144338, half = 4.302653 · 0.144338 / √3 = 0.358554
    ([1, 1, 2, 2, 1, 3], (0.416667, 0.058113, 0.775221, "unresolved")),
    # 0.125, 0.15: t(0.975, 1) = 12.706205, s = 0.017678, half = 0.158828
    ([0.5, 0.5, 0.6, 0.6], (0.1375, -0.021328, 0.296328, "holding")),
    # 0.75, 0.8, 0.775: s = 0.025, half = 4.302653 · 0.025 / √3 = 0.062103
    ([3, 3, 3.2, 3.2, 3.1, 3.1], (0.775, 0.712897, 0.837103, "contradicted")),
])
def test_cycle_ratio_pairs_each_cycle_of_p_consecutive_repetitions(streaming, want):
    """A cycle of P Streaming syncs over one vanilla sync, one ratio per P consecutive
    repetitions (hand-worked above), and its verdict on 1/P = 0.5."""
    from tools.bench.sync_summary import cycle_ratio

    got = cycle_ratio(streaming, [4.0] * len(streaming), 2)
    assert (got["mean"], got["low"], got["high"]) == pytest.approx(want[:3], abs=2e-6)
    assert got["at_most_one_over_p"] == want[3] and got["cycles"] == len(streaming) // 2


def test_delayed_syncs_are_paired_with_v0_on_the_layer_fragments():
    """`--delayed-outer`'s summary on hand-made times (P = 3, fragments 1, 2, 0, 1, 2, 0):
    each fragment's median extra, their mean over a cycle, and delayed minus V = 0 over the
    four layer-fragment repetitions, 2, 3, 3, 4 ms: mean 3, s = √(2/3), half-width
    t(0.975, 3)·s/√4 = 3.182446·0.816497/2 = 1.299228; means 5.5 and 2.5 ms, ratio 2.2."""
    import dataclasses

    import diloco_eqx as dl
    from tests.reference import make_toy
    from tools.bench.sync_summary import delayed_syncs

    cfg = dl.DiLoCoConfig(num_replicas=2, sync_period=6, streaming=True, num_fragments=3, delayed_outer="naive")
    ms = lambda *xs: [x / 1e3 for x in xs]  # noqa: E731
    times = {("delayed", 5): ms(*[1] * 6), ("delayed", "sync"): ms(5, 7, 2, 6, 8, 3),
             ("streaming_v0", 5): ms(*[2] * 6), ("streaming_v0", "sync"): ms(4, 5, 3, 4, 5, 3)}
    got = delayed_syncs(times, [1, 2, 0, 1, 2, 0], make_toy(4, 3), dataclasses.replace(cfg), vanilla_extra=0.01)
    assert got["delayed_outer"] == "naive"
    per = got["per_fragment"]
    assert [p["layers"] for p in per] == [[], [0, 2], [1, 3]] and [p["reps"] for p in per] == [2, 2, 2]
    assert [p["sync_apply_extra_s"] for p in per] == pytest.approx(ms(1.5, 4.5, 6.5))
    assert [p["over_vanilla"] for p in per] == pytest.approx([0.15, 0.45, 0.65])
    assert got["cycle_extra_s"] == pytest.approx(12.5 / 3 / 1e3)
    d = got["layer_sync_minus_v0_s"]
    assert (d["mean"], d["low"], d["high"], d["n"]) == pytest.approx((3e-3, 1.700772e-3, 4.299228e-3, 4), rel=1e-5)
    assert got["layer_sync_over_v0"] == pytest.approx(2.2)


@pytest.mark.slow
def test_sync_cost_only_json_with_the_sequential_order(tmp_path):
    """`--sync-cost-only --fragment-order sequential` times Streaming on contiguous layer
    groups: with P = 3 the 1M model's 4 layers go to fragments 1 and 2 as {0, 1} and {2, 3};
    `--compare-order interleaved` times {0, 2} and {1, 3} in the same repetitions, paired
    over the 4 repetitions that synced a layer fragment, with the verdict its interval gives;
    `--delayed-outer eager` times V = 0 with eager delayed outer updates beside V = 0."""
    import numpy as np

    from tools.bench.report import format_sync_cost

    result = benchmark_json(tmp_path, "--sync-cost-only", "--sizes", "1M", "--reps", "6",
                            "--fragment-order", "sequential", "--num-fragments", "3",
                            "--compare-order", "interleaved", "--delayed-outer", "eager")
    cost = result["sync_cost"]["1M"]
    assert cost["fragment_order"] == "sequential"
    per = cost["streaming_per_fragment"]
    assert [p["layers"] for p in per] == [[], [0, 1], [2, 3]] and [p["reps"] for p in per] == [2, 2, 2]
    assert per[1]["param_fraction"] == pytest.approx(per[2]["param_fraction"])
    compared = cost["compared_order"]
    assert compared["fragment_order"] == "interleaved"
    assert [p["layers"] for p in compared["streaming_per_fragment"]] == [[], [0, 2], [1, 3]]
    d = compared["layer_sync_difference_s"]
    assert d["n"] == 4 and d["low"] < d["mean"] < d["high"]
    assert compared["compared_is_cheaper"] == ("holding" if d["low"] > 0 else "contradicted" if d["high"] < 0
                                               else "unresolved")
    delayed = cost["delayed"]  # V = 0 with eager delayed outer updates, on the sequential order
    assert delayed["delayed_outer"] == "eager"
    assert [p["layers"] for p in delayed["per_fragment"]] == [[], [0, 1], [2, 3]]
    assert delayed["layer_sync_minus_v0_s"]["n"] == 4 and delayed["layer_sync_over_v0"] > 0
    text = "\n".join(format_sync_cost(result["sync_cost"]))
    assert "sequential order; stash" in text and "interleaved order in the same repetitions" in text
    assert "delayed_outer='eager'" in text
    assert np.isfinite(compared["streaming_cycle_over_vanilla"])


@pytest.mark.slow
def test_nonsync_json(tmp_path):
    result = benchmark_json(tmp_path, "--nonsync", "--sizes", "1M", "--reps", "3")
    events = result["nonsync"]["1M"]["events"]
    assert set(events) == {"diloco", "streaming", "streaming_free"}
    assert all("outer_fragment0_change" in e for e in events.values())
    modes = result["nonsync"]["1M"]["modes"]  # on CPU without a mesh the default exchange waits
    assert modes["streaming"]["exchange_after_inner"] is True and modes["streaming_free"]["exchange_after_inner"] is False
    check_nonsync_json(result)


def test_a_nonsync_run_saves_the_json_as_each_phase_ends(tmp_path, monkeypatch):
    """The timings are in the JSON once measured, then the events beside them; a later phase
    that fails (a trace that crashes the process) leaves both, and never half a file."""
    from tools.bench import common
    from tools.bench import nonsync as N

    path, seen = tmp_path / "n.json", []

    def phases(model, size, k, sync_period, num_fragments, reps, trace, report):
        for out in ({"modes": {"diloco": 1.004}}, {"modes": {"diloco": 1.004}, "events": {"diloco": [0.0]}}):
            report(out)
            seen.append(json.loads(path.read_text()))
        raise RuntimeError("the trace crashed")

    monkeypatch.setattr(N, "nonsync", phases)
    monkeypatch.setattr(common, "model", lambda size, dtype: None)
    with pytest.raises(RuntimeError, match="the trace crashed"):
        N.run_nonsync(common.SIZES[:1], 7, 100, 5, save=functools.partial(common.write_json, str(path)))
    assert [r["nonsync"] for r in seen] == [{"1M": {"modes": {"diloco": 1.004}}},
                                            {"1M": {"modes": {"diloco": 1.004}, "events": {"diloco": [0.0]}}}]
    assert seen[-1]["settings"]["reps"] == 7 and json.loads(path.read_text()) == seen[-1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["n.json"]


def test_the_event_check_is_printed_with_what_each_figure_should_be():
    from tools.bench.report import format_events

    e = {"ends": [99, 100, 101], "applied_at": 101, "fragment0_spread": [0.00801, 0.01, 0.0],
         "outer_fragment0_change": [0.0, 0.0, 0.00667], "outer_abs_sum": 11673.1}
    assert format_events("1M", "streaming", e) == (
        "1M events at t = 99..101, streaming: islands' largest difference over fragment 0 after each step "
        "0.00801, 0.01, 0 (expected 0 at the apply, t = 101, and only there); outer fragment 0's change in each "
        "step 0, 0, 0.00667 (expected above 0 at t = 101 and only there); outer Σ|θ| 11673.1")


def test_a_failed_trace_is_recorded_not_raised(tmp_path):
    """A step that fails under the profiler gives {"trace_error": ...}: the timings and
    events measured before it stand."""
    from tools.bench.nonsync import NONSYNC_MODES, traced
    from tools.bench.report import format_nonsync

    class Failing:
        def step_placed(self, state, batches):
            raise RuntimeError("CUPTI went away")

    steps = {m: [None, Failing()] for m in NONSYNC_MODES}
    got = traced(steps, dict.fromkeys(NONSYNC_MODES), str(tmp_path / "trace"))
    assert got == {"trace_error": "RuntimeError: CUPTI went away"}
    assert format_nonsync({"1M": {"reps": 2, "plain_s": 0.1, "modes": {}, **got}}).splitlines()[-1] == \
        "1M trace failed: RuntimeError: CUPTI went away"


def check_orders_json(result: dict) -> None:
    """What a `--cpu-orders` JSON must hold: each order's extras are its own resident bytes
    over its own plain step's, against the same formula as the quick JSON's modes; the two
    workers' plain steps compiled to different memory (each order took effect)."""
    for size, c in result["cpu_orders"].items():
        assert set(c["modes"]) == {"memory", "concurrency"}
        assert c["resident_bytes"]["memory"]["plain"] != c["resident_bytes"]["concurrency"]["plain"]
        for order, modes in c["modes"].items():
            plain = c["resident_bytes"][order]["plain"]
            for mode, m in modes.items():
                assert m["extra_bytes"] == c["resident_bytes"][order][mode] - plain > 0, (size, order, mode)
            assert modes["vanilla"]["expected_extra_bytes"] == 8 * c["params"]
            assert modes["streaming_deferred"]["expected_extra_bytes"] > 8 * c["params"]
        for name, t in c["times"].items():
            assert t["time_ratio_low"] <= t["time_ratio"] <= t["time_ratio_high"], name
            assert t["memory_s"] > 0 and t["concurrency_s"] > 0


@pytest.mark.slow
def test_cpu_orders_json(tmp_path):
    check_orders_json(benchmark_json(tmp_path, "--cpu-orders", "--sizes", "1M", "--reps", "2"))


def check_exchange_placement_json(result: dict) -> None:
    """What an `--exchange-placement` JSON must hold: both placements' extras over the same
    plain step against the stash formula, and paired time ratios with their intervals."""
    for size, c in result["exchange_placement"].items():
        assert set(c["memory"]) == {"free", "after_inner"}
        for m in c["memory"].values():
            assert m["extra_bytes"] > 8 * c["params"] and m["expected_extra_bytes"] > 8 * c["params"]
            assert abs(m["live_extra_bytes"] / m["expected_extra_bytes"] - 1) < 0.001, (size, m)
        assert set(c["times"]) == {"nonsync", "stash", "exchange"}
        for name, t in c["times"].items():
            assert t["time_ratio_low"] <= t["time_ratio"] <= t["time_ratio_high"], name
            assert t["free_s"] > 0 and t["after_inner_s"] > 0


@pytest.mark.slow
def test_exchange_placement_json(tmp_path):
    check_exchange_placement_json(benchmark_json(tmp_path, "--exchange-placement", "--sizes", "1M", "--reps", "2"))


def check_host_memory_json(result: dict) -> None:
    """What a `--host-memory` JSON must hold: both settings of every phase timed in pairs, the
    kept heap faulting (next to) nothing in, glibc's default faulting in every step."""
    for size, c in result["host_memory"].items():
        assert set(c["phases"]) == {"plain", "nonsync", "sync"}
        for phase, p in c["phases"].items():
            assert p["ratio_low"] <= p["ratio_mean"] <= p["ratio_high"], (size, phase)
            assert p["keep"]["s"] > 0 and p["default"]["s"] > 0
            assert p["keep"]["faults"] <= 0.01 * p["default"]["faults"], (size, phase, p)


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="compares glibc's malloc settings")
def test_host_memory_json(tmp_path):
    check_host_memory_json(benchmark_json(tmp_path, "--host-memory", "--sizes", "1M", "--reps", "3"))
