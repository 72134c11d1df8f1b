"""tools/comm_report: bytes measured from the compiled step, pinned for one small model."""

import functools
import json

import pytest

from tools import comm_report

SMALL = ["--layers", "2", "--width", "32", "--heads", "2", "--seq-len", "16"]
# The 2-layer, width-32 transformer: embeddings 256·32 + 16·32, final norm 32, head 32·256
# (fragment 0, 25,120 values); each layer 2·32 norms + 32·96 qkv + 32·32 out + 2·32·128 MLP
# = 12,352 values.
FRAG0, LAYER = 256 * 32 + 16 * 32 + 32 + 32 * 256, 2 * 32 + 32 * 96 + 32 * 32 + 2 * 32 * 128
TOTAL = FRAG0 + 2 * LAYER


# the measurements compile several steps each: one worker runs these tests and measures
# each set of flags once
pytestmark = pytest.mark.xdist_group("comm_report")


@functools.cache
def report(*extra, measure=comm_report.measure):  # the real one, whatever a test patches in
    return measure(comm_report.build_parser().parse_args(SMALL + list(extra)))


def test_float32_bytes_are_the_parameter_bytes():
    r = report("--num-fragments", "3")  # fragments: 0, layer 0, layer 1
    assert r["num_params"] == TOTAL == 41_632
    assert r["param_bytes"] == 4 * TOTAL
    assert r["vanilla_collective_bytes"] == 4 * TOTAL
    assert r["ddp_collective_bytes_per_step"] == 4 * TOTAL
    assert [f["param_bytes"] for f in r["fragments"]] == [4 * FRAG0, 4 * LAYER, 4 * LAYER]
    for f in r["fragments"]:
        assert f["collective_bytes"] == f["param_bytes"]
        assert f["ring_bytes"] == f["param_bytes"]  # ring all-reduce on D=2: 2·(1/2)·payload
        assert f["formula_bytes"] == 2 * f["param_bytes"]


@pytest.mark.slow  # three measurements; test_islands checks fp4's bytes in the fast set
@pytest.mark.parametrize("vanilla", [False, True])
def test_compressed_bytes(vanilla):
    flags = ["--no-streaming"] if vanilla else ["--num-fragments", "3"]
    f32 = report(*flags)["fragments"]
    bf16 = report(*flags, "--compression", "bf16")["fragments"]
    fp4 = report(*flags, "--compression", "fp4")["fragments"]
    # leaves per fragment: fragment 0 has embed, pos, final norm, head (4 tensors);
    # a layer fragment has 6 (2 norms, qkv, out, 2 MLP)
    leaves = [4 + 6] if vanilla else [4, 6, 6]  # a stacked leaf holds both layers
    for a, b, c, n in zip(f32, bf16, fp4, leaves):
        assert b["collective_bytes"] * 2 == a["collective_bytes"]
        assert c["collective_bytes"] <= a["params"] / 2 + 4 * n
        assert c["collective_bytes"] == a["params"] // 2 + 4 * n  # every leaf has an even size


def test_cli_writes_json(tmp_path, capsys, monkeypatch):
    """The CLI prints the report and writes its JSON (the measurement, with the flags the CLI
    parsed, is the one test_float32_bytes_are_the_parameter_bytes checks: reused, not
    compiled again)."""
    out = tmp_path / "comm.json"
    flags = ("--num-fragments", "3")
    parsed = []
    monkeypatch.setattr(comm_report, "measure", lambda args: parsed.append(args) or report(*flags))
    assert comm_report.main(SMALL + [*flags, "--json", str(out)]) == 0
    assert parsed[0] == comm_report.build_parser().parse_args(SMALL + [*flags, "--json", str(out)])
    r = json.loads(out.read_text())
    assert set(r) >= {"param_bytes", "fragments", "vanilla_collective_bytes"}
    assert [f["collective_bytes"] for f in r["fragments"]] == [4 * FRAG0, 4 * LAYER, 4 * LAYER]
    text = capsys.readouterr().out
    assert "per fragment" in text and "DDP" in text and "vanilla DiLoCo, H=30" in text


def test_bad_knob_is_a_clear_error(capsys):
    assert comm_report.main(SMALL + ["--compression", "int3"]) == 2
    assert "compression must be one of" in capsys.readouterr().err


@pytest.mark.parametrize("data,fsdp", [pytest.param(2, 1, marks=pytest.mark.slow),
                                       pytest.param(1, 2, marks=pytest.mark.slow),
                                       pytest.param(2, 2, marks=pytest.mark.slow)])
def test_island_mesh_bytes(data, fsdp):
    """Islands of data × fsdp devices: each island still sends each fragment once per sync
    (the outer copy is split over its devices, each sending its piece), so the per-island
    bytes equal the one-device islands' and each device sends 1/(data·fsdp) of them. What
    the island's devices exchange among themselves in a sync (partial norms, pieces of the
    outer fragment) stays inside."""
    flat = report("--num-fragments", "3")
    r = report("--num-fragments", "3", "--data-parallel", str(data), "--fsdp", str(fsdp))
    assert r["config"]["devices_per_island"] == data * fsdp
    for a, b in zip(flat["fragments"], r["fragments"]):
        assert b["collective_bytes"] == a["collective_bytes"] == a["param_bytes"]
        assert b["collective_bytes_per_device"] == a["param_bytes"] // (data * fsdp)
        assert a["inside_island_bytes_per_device"] == 0 < b["inside_island_bytes_per_device"]
    assert r["vanilla_collective_bytes"] == flat["vanilla_collective_bytes"]


def test_island_mesh_flags_are_checked(capsys):
    assert comm_report.main(SMALL + ["--data-parallel", "3"]) == 2
    assert "--data-parallel=3 must divide each island's batch" in capsys.readouterr().err


@pytest.mark.slow  # three compiled steps; the codec's byte count itself: test_codecs
def test_topk_payload_measured_in_the_hlo_is_the_codecs_count():
    """SparseLoCo's all-gather, read out of the compiled step: each island's payload is
    exactly the codec's values + indices + scales for its tensors, and the formula column is
    twice that (the convention 2|Θ_f|b follows for dense codecs)."""
    from diloco_eqx import codecs
    from diloco_eqx.analysis import comms

    r = report("--no-streaming", "--compression", "topk", "--error-feedback", "--topk-density", "0.01",
               "--topk-chunk", "1024")
    (f,) = r["fragments"]
    # vanilla tensors: embed 8192, position 512, final norm 32, head 8192; the stack's two
    # norms 2 × 32 each, qkv 6144, out 2048, MLP 2 × 8192 (sizes summing to TOTAL)
    sizes = [8192, 512, 32, 8192, 64, 64, 6144, 2048, 8192, 8192]
    codec = codecs.TopK(0.01, 1024, 2)
    assert sum(sizes) == TOTAL
    assert f["collective_bytes"] == sum(codec.payload_bytes(n) for n in sizes) == f["formula_bytes"] / 2
    assert sum(codec.index_bytes(n) for n in sizes) > 0.7 * f["collective_bytes"]  # mostly positions
    assert comms.codec_sync_bytes(sizes, codec) == f["formula_bytes"]
