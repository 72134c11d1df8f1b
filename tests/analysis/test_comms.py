"""comms: reading collectives and branch structure out of HLO text."""

import pytest

from diloco_eqx.analysis import comms

HLO = """HloModule m

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%sync_branch (p: (f32[4,3], bf16[8])) -> (f32[4,3], bf16[8]) {
  %p = (f32[4,3], bf16[8]) parameter(0)
  %all-reduce = (f32[4,3]{1,0}, bf16[8]{0}) all-reduce(%x, %y), channel_id=1, to_apply=%add, metadata={op_name="jit(f)/diloco_sync/psum"}
  ROOT %t = (f32[4,3], bf16[8]) tuple(%all-reduce)
}

%skip_branch (p: (f32[4,3], bf16[8])) -> (f32[4,3], bf16[8]) {
  ROOT %p = (f32[4,3], bf16[8]) parameter(0)
}

%fused (x: f32[2]) -> f32[2] {
  ROOT %x = f32[2] parameter(0)
}

%event_body (q: (s32[], f32[2])) -> (s32[], f32[2]) {
  %q = (s32[], f32[2]) parameter(0)
  %ar2 = f32[2]{0} all-reduce(%y), channel_id=2, to_apply=%add, metadata={op_name="jit(f)/diloco_apply/schedule_event/while/body/psum"}
  ROOT %u = (s32[], f32[2]) tuple(%i, %ar2)
}

%event_cond (q: (s32[], f32[2])) -> pred[] {
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%layer_body (q: (s32[], f32[2])) -> (s32[], f32[2]) {
  ROOT %q = (s32[], f32[2]) parameter(0)
}

ENTRY %main (x: f32[2]) -> f32[2] {
  %x = f32[2] parameter(0)
  %ag-start = (f32[2]{0}, f32[8]{0}) all-gather-start(%x), dimensions={0}
  %ag-done = f32[8]{0} all-gather-done(%ag-start)
  %f = f32[2] fusion(%x), kind=kLoop, calls=%fused
  %c = (f32[4,3], bf16[8]) conditional(%pred, %t1, %t2), branch_computations={%sync_branch, %skip_branch}
  %w = (s32[], f32[2]) while(%init), condition=%event_cond, body=%event_body, metadata={op_name="jit(f)/diloco_apply/schedule_event/while" stack_frame_id=3}
  %scan = (s32[], f32[2]) while(%init), condition=%event_cond, body=%layer_body, metadata={op_name="jit(f)/inner_step/while"}, backend_config={"known_trip_count":{"n":"8"}}
  ROOT %r = f32[2] copy(%f)
}
"""


def test_collectives_kinds_bytes_and_places():
    found = {c.name: c for c in comms.collectives(HLO)}
    assert set(found) == {"all-reduce", "ag-start", "ar2"}
    ar = found["all-reduce"]
    assert (ar.kind, ar.computation, ar.bytes) == ("all-reduce", "sync_branch", 4 * 3 * 4 + 8 * 2)
    assert "diloco_sync" in ar.op_name
    ag = found["ag-start"]
    assert (ag.kind, ag.computation, ag.bytes) == ("all-gather", "main", 8 * 4)


def test_unconditional_and_branch_computations():
    """A conditional's branches and a schedule event's loop body run only on some steps; a
    loop of the model (here a scan over layers) and every loop's condition on all of them."""
    assert comms.unconditional_computations(HLO) == {"main", "fused", "event_cond", "layer_body"}
    assert comms.branch_computations(HLO) == {"sync_branch", "skip_branch", "add", "event_body"}


def test_copies_every_step_and_in_events_skip_fusions():
    hlo = HLO.replace("  ROOT %s = f32[] add(%a, %b)", "  %c1 = f32[16]{0} copy(%a)\n  ROOT %s = f32[] add(%a, %b)")
    hlo = hlo.replace("  ROOT %q = (s32[], f32[2]) parameter(0)\n}", "  %c2 = bf16[3,5]{1,0} copy(%q)\n  ROOT %q = (s32[], f32[2]) parameter(0)\n}")
    hlo = hlo.replace("  ROOT %x = f32[2] parameter(0)\n}", "  %c3 = f32[7]{0} copy(%x)\n  ROOT %x = f32[2] parameter(0)\n}")
    hlo = hlo.replace("  ROOT %t = (f32[4,3], bf16[8]) tuple(%all-reduce)", "  %c4 = f32[9]{0} copy(%x)\n  ROOT %t = (f32[4,3], bf16[8]) tuple(%all-reduce)")
    # main's ROOT copy (f32[2]) and the scan body's (bf16[3,5]) run every step; `add` is
    # reached only from the sync branch, `fused` is a fusion's body, c4 sits in a branch
    assert comms.every_step_copy_bytes(hlo) == 2 * 4 + 3 * 5 * 2
    # and the events' copies are the other two that no fusion holds
    assert sorted(comms.event_copies(hlo)) == [("f32", (9,)), ("f32", (16,))]


def test_bytes_sent_matches_a_step_by_step_count():
    import diloco_eqx as dl

    params = [5, 7, 11, 13]
    for sched in (dl.Schedule(12, 4, 1), dl.Schedule(10, 4), dl.Schedule(7, 3, 2), dl.Schedule(5)):
        per_fragment = params[: sched.num_fragments]
        if sched.num_fragments == 1:
            per_fragment = [sum(params)]
        total = 0
        for t in range(1, 60):
            f = sched.sync_fragment(t)
            if f is not None:
                total += 2 * per_fragment[f] * 4
            assert comms.bytes_sent(t, per_fragment, sched) == total, (sched, t)
    assert comms.bytes_sent(3, [10, 20]) == 3 * 2 * 30 * 4  # DDP: everything, every step


def test_topk_bytes_count_values_indices_and_scales():
    """SparseLoCo's payload, counted by hand: TopK(0.03, 4096, 2) on a 10000-value tensor
    is 3 chunks of k = round(122.88) = 123: ceil(369·2/8) = 93 code bytes, 2·369 = 738
    index bytes, 3·4 scale bytes; on a 64-value one c = 64, k = round(1.92) = 2: 1 + 4 + 4."""
    import diloco_eqx as dl
    from diloco_eqx import codecs
    from tests.reference import make_toy

    topk = codecs.TopK(0.03, 4096, 2)
    assert comms.codec_sync_bytes([10000, 64], topk) == 2 * ((93 + 738 + 12) + (1 + 4 + 4)) == 1704
    assert comms.codec_index_bytes([10000, 64], topk) == 2 * (738 + 4) == 1484
    # vanilla H = 30: 10 syncs in 300 steps (none yet at 29)
    sched = dl.Schedule(30)
    assert comms.bytes_sent(300, [10064], sched, fragment_bytes=[1704]) == 17040
    assert comms.bytes_sent(29, [10064], sched, fragment_bytes=[1704]) == 0
    # dense codecs: float32 is sync_bytes exactly; fp4's payload adds its 4-byte scale per
    # tensor to the n/2 bytes that bits_per_value counts
    assert comms.codec_sync_bytes([10000, 64], codecs.Float32()) == comms.sync_bytes(10064, 4)
    assert comms.codec_sync_bytes([10000, 63], codecs.Float4()) == 2 * (5000 + 4 + 32 + 4)
    assert comms.codec_index_bytes([10000], codecs.Float4()) == 0
    # the tensors a sync encodes: the toy's float leaves (embed 3, w 4×3, b 4×3, head 3),
    # streaming P = 3 (interleaved): embed and head, then layers {0, 2} and {1, 3} of w and b
    toy = make_toy(4, 3)
    assert comms.fragment_tensor_sizes(toy, dl.DiLoCoConfig()) == [[3, 12, 12, 3]]
    cfg = dl.DiLoCoConfig(streaming=True, num_fragments=3, sync_period=6)
    sizes = comms.fragment_tensor_sizes(toy, cfg)
    assert sizes == [[3, 3], [6, 6], [6, 6]]
    # Δh = 2: after 12 steps fragments 1, 2, 0, 1, 2, 0 synced twice each
    per = [comms.codec_sync_bytes(s, topk) for s in sizes]
    assert comms.bytes_sent(12, [6, 12, 12], cfg.schedule, fragment_bytes=per) == 2 * sum(per)
    assert comms.bytes_sent(12, [6, 12, 12], cfg.schedule, fragment_bytes=[2 * 4 * n for n in (6, 12, 12)]) \
        == comms.bytes_sent(12, [6, 12, 12], cfg.schedule)


@pytest.mark.parametrize("line,size", [
    ("%a = f32[4] all-reduce(%x), channel_id=1, replica_groups={{0,1},{2,3}}, to_apply=%r", 2),
    ("%a = f32[4] all-reduce(%x), channel_id=1, replica_groups=[2,4]<=[8], to_apply=%r", 4),
    ("%a = s32[] all-reduce(%x), replica_groups=mesh['diloco'=2] {'diloco'}, to_apply=%r", 2),
    ("%a = f32[4] all-reduce(%x), replica_groups=mesh['diloco'=2,'data'=4] {'data'}, to_apply=%r", 4),
    ("%a = f32[4] all-reduce(%x), replica_groups=mesh['diloco'=2,'data'=2,'fsdp'=2] {'diloco','fsdp'}, "
     "to_apply=%r", 4),
    ("%a = f32[4] all-reduce(%x), to_apply=%r", 1),
])
def test_group_size_in_every_notation(line, size):
    """jax 0.10's XLA prints explicit or iota groups; jax 0.12's prints mesh axes."""
    assert comms.group_size(line) == size
