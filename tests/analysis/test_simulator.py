"""The bandwidth simulator against closed forms worked out by hand."""

import math

import pytest

from diloco_eqx.analysis.simulator import (Method, Workload, bandwidth_table, required_bandwidth,
                                  simulate, uniform_layers)

T = 0.1  # seconds per step


def test_ddp_one_layer_closed_form():
    # One layer of 1e9 params, 16 bits, 2 workers (ring factor 1): the gradient leaves when
    # the backward ends (= end of compute) and takes c = 16e9 / (bw·1e9) s; every step waits.
    w = Workload((10**9,), T)
    for bw in (10.0, 100.0, 1000.0):
        c = 16e9 / (bw * 1e9)
        r = simulate(w, Method("ddp"), bw, steps=50)
        assert r.utilization == pytest.approx(T / (T + c), rel=1e-9)
        assert r.bits_sent == pytest.approx(50 * 16e9)


def test_latency_and_ring_factor():
    # 4 workers: ring factor 2·3/4 = 1.5; latency adds per transfer
    w = Workload((10**8,), T, num_workers=4)
    c = 1e8 * 16 * 1.5 / 1e10 + 0.01
    assert simulate(w, Method("ddp"), 10.0, latency=0.01, steps=20).utilization == pytest.approx(T / (T + c))


def test_vanilla_blocks_once_per_period():
    w = Workload((10**9,), T)
    c = 16e9 / 5e9
    r = simulate(w, Method("diloco", sync_period=50), 5.0, steps=200)
    assert r.utilization == pytest.approx(50 * T / (50 * T + c))


def test_ddp_gradient_overlaps_the_backward_pass():
    # Two equal layers: layer 1's gradient is ready 2/3 of the way (1/3 forward + 1/3 of the
    # backward); layer 0's at the end. With c per layer = 0.05 s the link is busy from
    # 0.0667 to 0.1667, so each step ends 0.0667 s late.
    w = Workload((10**8, 10**8), T)
    bw = 1e8 * 16 / 0.05 / 1e9
    r = simulate(w, Method("ddp"), bw, steps=30)
    assert r.utilization == pytest.approx(T / (T + (T * 2 / 3 + 0.1 - T)), rel=1e-6)


def test_overlap_hides_a_transfer_shorter_than_the_window():
    # Streaming P=2 over 2 layers, H=20 (Δh=10), V=2: fragment 0 (layer 0) is ready at the
    # end of step t and may take 2 full steps; fragment 1 (layer 1) leaves at 2/3 of step t.
    w = Workload((10**8, 10**8), T)
    for transfer, stalled in ((0.19, 0.0), (0.25, 0.05)):
        bw = 1e8 * 16 / transfer / 1e9
        r = simulate(w, Method("streaming", 20, 2, overlap_steps=2), bw, steps=200)
        # stall per fragment-0 sync = max(0, c − 2T); fragment 1 has 1/3 step more slack
        per_sync = [max(0.0, transfer - 2 * T), max(0.0, transfer - 2 * T - T / 3)]
        assert r.wall_time == pytest.approx(200 * T + 10 * sum(per_sync), rel=1e-9)
        assert (r.utilization > 1 - 1e-12) == (stalled == 0.0)
    no_overlap = simulate(w, Method("streaming", 20, 2, overlap_steps=0), 1e8 * 16 / 0.19 / 1e9, steps=200)
    assert no_overlap.utilization < 1.0


def test_required_bandwidth_inverts_the_closed_form():
    w = Workload((10**9,), T)
    for u in (0.5, 0.9, 0.99):
        c = T * (1 / u - 1)
        assert required_bandwidth(w, Method("ddp"), u) == pytest.approx(16 / c, rel=2e-3)
    # a latency longer than the whole slack can never reach the target
    assert math.isinf(required_bandwidth(w, Method("ddp"), 0.9, latency=0.05))


def test_bad_knobs_are_named():
    with pytest.raises(ValueError, match="method must be one of"):
        Method("allreduce")
    with pytest.raises(ValueError, match=r"overlap_steps \(V\) must be in \[0, H_eff\)"):
        simulate(Workload((1, 1), T), Method("streaming", 4, 2, overlap_steps=4), 1.0)
    with pytest.raises(ValueError, match="bandwidth_gbps must be a number in"):
        simulate(Workload((1,), T), Method("ddp"), 0.0)
    with pytest.raises(ValueError, match="step_time"):
        Workload((1,), 0.0)


PAPER_95 = {"ddp": 222.3, "diloco": 23.3, "streaming": 16.0, "overlap": 9.1, "fp4": 2.0}


def test_table4_within_a_factor_of_two_of_the_paper():
    w = Workload(uniform_layers(1e9, 24), T)
    ms = [("ddp", Method("ddp")), ("diloco", Method("diloco", 100)),
          ("streaming", Method("streaming", 100, 8)), ("overlap", Method("streaming", 100, 8, 1)),
          ("fp4", Method("streaming", 100, 8, 1, bits=4))]
    table = bandwidth_table(w, ms, targets=(0.95,))
    for name, (ours,) in table.items():
        assert PAPER_95[name] / 2 <= ours <= PAPER_95[name] * 2, (name, ours)
    # and the ordering the paper reports
    assert table["ddp"] > table["diloco"] > table["streaming"] > table["overlap"] > table["fp4"]


def test_delayed_outer_update_hides_a_transfer_shorter_than_a_round():
    # Vanilla H=50 (a round is 5 s of compute), one 1e9-parameter layer at 16 bits: at 5 Gbit/s
    # a sync's transfer takes 3.2 s. Blocking, every round stalls 3.2 s; with the exchange in
    # flight for one round (eager / naive delayed updates) it is needed only at the next sync,
    # 5 s later, so nothing stalls; at 2.5 Gbit/s (6.4 s) it no longer fits and stalls.
    w = Workload((10**9,), T)
    blocking = simulate(w, Method("diloco", sync_period=50), 5.0, steps=200)
    delayed = simulate(w, Method("diloco", sync_period=50, outer_delay=1), 5.0, steps=200)
    assert blocking.utilization == pytest.approx(5.0 / (5.0 + 3.2))
    assert delayed.utilization == pytest.approx(1.0) and delayed.bits_sent == blocking.bits_sent
    assert simulate(w, Method("diloco", sync_period=50, outer_delay=1), 2.5, steps=200).utilization < 0.95
    with pytest.raises(ValueError, match="outer_delay applies to diloco and streaming"):
        Method("ddp", outer_delay=1)
