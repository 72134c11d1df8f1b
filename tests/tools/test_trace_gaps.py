"""tools/trace_gaps.py on a hand-made trace whose busy time, gaps and reads are worked out below."""

import gzip
import json

import pytest

from tools import trace_gaps

HOST, DEVICE = 1, 2


def _x(pid, name, ts, dur):
    return {"ph": "X", "pid": pid, "tid": 0, "name": name, "ts": ts, "dur": dur}


def _trace(tmp_path, events):
    meta = [{"ph": "M", "pid": HOST, "name": "process_name", "args": {"name": "/host:CPU"}},
            {"ph": "M", "pid": DEVICE, "name": "process_name", "args": {"name": "/device:GPU:0"}}]
    path = tmp_path / "t.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": meta + events}, f)
    return str(path)


def test_busy_span_gaps_and_reads_per_mode(tmp_path):
    """plain_0 in [0, 100): kernels [10, 20) and [25, 40), a read [45, 46), a kernel [50, 90):
    busy 10 + 15 + 1 + 40 = 66, span 90 − 10 = 80, gaps 5 + 5 + 4 = 14, one read followed by
    a 4 us gap, host after 100 − 90 = 10. plain_1 in [200, 300): one kernel [210, 280):
    busy 70, span 70, no gaps, host after 20. The mode's figures are the medians of its
    two steps. s_0 in [400, 500): a kernel [402, 404), an H2D copy [405, 406), a kernel
    [420, 440): busy 2 + 1 + 20 = 23, span 38, gaps 1 + 14 = 15, host after 60."""
    path = _trace(tmp_path, [
        _x(HOST, "mode_plain_0", 0, 100), _x(HOST, "mode_plain_1", 200, 100), _x(HOST, "mode_s_0", 400, 100),
        _x(HOST, "other", 0, 500),
        _x(DEVICE, "k1", 10, 10), _x(DEVICE, "k2", 25, 15), _x(DEVICE, "MemcpyD2H", 45, 1), _x(DEVICE, "k3", 50, 40),
        _x(DEVICE, "k4", 210, 70),
        _x(DEVICE, "k0", 402, 2), _x(DEVICE, "MemcpyH2D", 405, 1), _x(DEVICE, "k5", 420, 20),
    ])
    got = trace_gaps.summarize(path)
    assert got["plain"] == {"busy": 68.0, "span": 75.0, "gaps": 7.0, "d2h": 0.5, "after_d2h": 2.0,
                            "host_after": 15.0, "events": 2.5, "graphs_off": 0,
                            "steps": 2}
    assert got["s"] == {"busy": 23, "span": 38, "gaps": 15, "d2h": 0, "after_d2h": 0, "host_after": 60,
                        "events": 3, "graphs_off": 0, "steps": 1}
    table = trace_gaps.format_summary(got).splitlines()
    assert table[1].split()[:4] == ["plain", "0.068", "0.075", "0us"]
    assert table[2].split()[:4] == ["s", "0.023", "0.038", "-37us"]


def test_a_step_can_begin_at_its_last_copy_in(tmp_path):
    """From the H2D copy on, s_0 of the trace above is the copy and k5: busy 21, span 35,
    gap 14; a step without such a copy is named."""
    path = _trace(tmp_path, [_x(HOST, "mode_s_0", 400, 100), _x(DEVICE, "k0", 402, 2),
                             _x(DEVICE, "MemcpyH2D", 405, 1), _x(DEVICE, "k5", 420, 20)])
    got = trace_gaps.summarize(path, start_at="MemcpyH2D")["s"]
    assert (got["busy"], got["span"], got["gaps"], got["events"]) == (21, 35, 14, 2)
    with pytest.raises(ValueError, match="mode_s_0: no device events inside the annotation from a 'k9' on"):
        trace_gaps.summarize(path, start_at="k9")


def test_a_step_with_no_device_events_is_named(tmp_path):
    path = _trace(tmp_path, [_x(HOST, "mode_plain_0", 0, 100), _x(DEVICE, "k", 150, 10)])
    with pytest.raises(ValueError, match="mode_plain_0: no device events inside the annotation"):
        trace_gaps.summarize(path)
    with pytest.raises(ValueError, match="no host annotation starts with 'step_'"):
        trace_gaps.summarize(path, prefix="step_")


def test_overlapping_events_count_once(tmp_path):
    """In [0, 100): a kernel [10, 50), a copy on another stream [20, 30) inside it, a kernel
    [40, 60) overlapping its end, a read [62, 63) and a kernel [70, 80): busy is the union
    [10, 60) + [62, 63) + [70, 80) = 61, span 70, gaps 2 + 7 = 9 (7 of them after the read)."""
    path = _trace(tmp_path, [_x(HOST, "mode_a_0", 0, 100), _x(DEVICE, "k1", 10, 40), _x(DEVICE, "copy", 20, 10),
                             _x(DEVICE, "k2", 40, 20), _x(DEVICE, "MemcpyD2H", 62, 1), _x(DEVICE, "k3", 70, 10)])
    got = trace_gaps.summarize(path)["a"]
    assert (got["busy"], got["span"], got["gaps"], got["after_d2h"], got["host_after"]) == (61, 70, 9, 7, 20)


def test_command_buffers_run_unrecorded_under_the_profiler_are_counted(tmp_path):
    """XLA:GPU's two notes that a command buffer ran kernel by kernel for the profiler: two
    in a_0, one in a_1 (median 1.5), none in b_0; a note outside every step, or a device
    event of that name, counts nowhere."""
    warn, off = "WARNING: CommandBuffer disabled when profiling", "command_buffer (disabled for profiling)"
    path = _trace(tmp_path, [
        _x(HOST, "mode_a_0", 0, 100), _x(HOST, warn, 5, 1), _x(HOST, off, 7, 1), _x(DEVICE, "k", 10, 10),
        _x(HOST, "mode_a_1", 200, 100), _x(HOST, off, 205, 1), _x(DEVICE, "k", 210, 10),
        _x(HOST, "mode_b_0", 400, 100), _x(HOST, "command_buffer", 405, 1), _x(DEVICE, "k", 410, 10),
        _x(HOST, warn, 600, 1), _x(DEVICE, warn, 411, 1),
    ])
    got = trace_gaps.summarize(path)
    assert (got["a"]["graphs_off"], got["b"]["graphs_off"]) == (1.5, 0)
    assert trace_gaps.format_summary(got).splitlines()[1].split()[-1] == "1.5"
