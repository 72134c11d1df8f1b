"""Compressed pseudo-gradients: codec error bounds, payload sizes, and the step against the
NumPy reference with quantization (and error feedback) written out independently."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import diloco_eqx as dl
from diloco_eqx import codecs as C
from tests.reference import NpAdamW, NpSGD, make_toy, np_quantize, np_run, np_topk, toy_loss, toy_to_numpy
from tests.helpers import N_LAYERS, WIDTH, batches, fast_and_slow, reference_run, run_jax

FORMATS = ["bf16", "fp8", "fp4"]

rng = np.random.default_rng(0)
TENSORS = {
    "normal": rng.standard_normal((33, 17)).astype(np.float32),
    "heavy_tailed": rng.standard_cauchy(999).astype(np.float32),
    "zeros": np.zeros((4, 5), np.float32),
    "one_value": np.array([-3.5], np.float32),
    "huge": (rng.standard_normal(257) * 1e37).astype(np.float32),
    "tiny": (rng.standard_normal(257) * 1e-30).astype(np.float32),
    "mixed_scales": np.concatenate([rng.standard_normal(50) * 1e6, rng.standard_normal(50) * 1e-6]).astype(np.float32),
    "boundaries": np.array([1, 0.75, -0.74, 0.375, 2**-7, 0.99 * 2**-7, -1], np.float32),
}


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("name", list(TENSORS))
def test_roundtrip_within_error_bound(fmt, name):
    x = TENSORS[name]
    got = np.asarray(C.roundtrip(jnp.asarray(x), fmt))
    assert got.shape == x.shape and got.dtype == np.float32
    # The bound, written out here rather than taken from the codec:
    a, m = np.abs(x).astype(np.float64), float(np.abs(x).max())
    bound = {
        "bf16": a * 2.0**-8,
        "fp8": np.maximum(a * 2.0**-4, m / 448 * 2.0**-10),
        "fp4": np.maximum(a / 3, m * 2.0**-7),
    }[fmt] * (1 + 1e-6)
    assert np.all(np.abs(got - x) <= bound)
    np.testing.assert_array_equal(got, np_quantize(x, fmt).astype(np.float32))
    # compiled, as the step runs it, the same bits (XLA rewrites divisions by constants)
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda v: C.roundtrip(v, fmt))(x)), got)
    if name == "zeros":
        assert not got.any()
    assert np.all(np.sign(got) * np.sign(x) >= 0)  # never flips a sign


def test_fp4_levels_by_hand():
    # scale = 1: 0.75 ties up to 1, -0.74 goes to -0.5, 0.375 ties up to 0.5,
    # 2^-7 ties up to 2^-6, just under 2^-7 becomes 0
    got = np.asarray(C.roundtrip(jnp.asarray(TENSORS["boundaries"]), "fp4"))
    np.testing.assert_array_equal(got, [1, 1, -0.5, 0.5, 2**-6, 0, -1])


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_is_rejected(fmt, bad):
    x = jnp.asarray([1.0, bad, 2.0], jnp.float32)
    with pytest.raises(Exception, match=f"compression '{fmt}': cannot quantize .*NaN or Inf"):
        C.encode(x, fmt)


def test_unknown_format_names_the_knob():
    with pytest.raises(ValueError, match=r"compression must be one of \('none', 'bf16', 'fp8', 'fp4', 'topk'\); got 'int4'"):
        dl.DiLoCoConfig(compression="int4")
    with pytest.raises(ValueError, match="error_feedback must be True or False"):
        dl.DiLoCoConfig(compression="fp4", error_feedback=1)
    with pytest.warns(UserWarning, match="error_feedback=True has no effect with compression='none'"):
        dl.DiLoCoConfig(error_feedback=True)


@pytest.mark.parametrize("n", [1, 2, 7, 1000])
def test_payload_bytes(n):
    x = jnp.linspace(-1, 1, n, dtype=jnp.float32)
    for fmt, per_value, scale in [("none", 4, 0), ("bf16", 2, 0), ("fp8", 1, 4)]:
        p = C.encode(x, fmt)
        assert sum(v.nbytes for v in p.values()) == n * per_value + scale == C.payload_bytes(n, fmt)
    p = C.encode(x, "fp4")
    assert p["values"].dtype == jnp.uint8 and p["values"].shape == ((n + 1) // 2,)
    assert sum(v.nbytes for v in p.values()) == (n + 1) // 2 + 4 == C.payload_bytes(n, "fp4")


def _reference(cfg, data, inner_np):
    return reference_run(cfg, data, inner_np)


CASES = [
    dict(num_replicas=2, sync_period=4),
    dict(num_replicas=4, sync_period=6, streaming=True, num_fragments=3, overlap_steps=1, alpha=0.5),
    dict(num_replicas=2, sync_period=6, streaming=True, num_fragments=3, fragment_order="sequential"),
]


# by default every pair of (format, error feedback, case) values once: 9 of the 18
@pytest.mark.parametrize("fmt,error_feedback,case",
                         fast_and_slow(list(itertools.product(FORMATS, [False, True], range(len(CASES))))))
def test_step_matches_reference_with_compression(fmt, error_feedback, case):
    cfg = dl.DiLoCoConfig(**CASES[case], compression=fmt, error_feedback=error_feedback)
    data = batches(18)
    losses, state = run_jax(cfg, optax.sgd(0.05), data)
    ref_losses, ref_outer, ref_islands = _reference(cfg, data, NpSGD(0.05))
    np.testing.assert_allclose(losses, ref_losses, rtol=2e-5, atol=2e-5)
    outer = toy_to_numpy(state.outer)  # run_jax's state: every sync folded in
    for name in outer:
        np.testing.assert_allclose(outer[name], ref_outer[name], rtol=2e-5, atol=2e-5)
    # and compression changes the result (so the comparison above is not vacuous)
    plain = _reference(dl.DiLoCoConfig(**CASES[case]), data, NpSGD(0.05))[1]
    assert any(not np.allclose(plain[n], ref_outer[n], rtol=1e-4, atol=1e-6) for n in outer)
    assert (state.residual is not None) == error_feedback


@pytest.mark.slow  # the backend grid of test_islands covers fp4 on meshes in the fast run
@pytest.mark.parametrize("fmt", ["bf16", "fp4"])
def test_compressed_step_same_on_any_mesh(fmt):
    cfg = dl.DiLoCoConfig(num_replicas=4, sync_period=6, streaming=True, num_fragments=3,
                          overlap_steps=1, compression=fmt, error_feedback=True)
    data = batches(12)
    l0, s0 = run_jax(cfg, optax.sgd(0.05), data)
    for d in (2, 4):
        l1, s1 = run_jax(cfg, optax.sgd(0.05), data, mesh=dl.make_mesh(d))
        np.testing.assert_allclose(l1, l0, rtol=1e-6, atol=1e-6)
        for name, want in toy_to_numpy(s0.outer).items():
            np.testing.assert_allclose(toy_to_numpy(s1.outer)[name], want, rtol=1e-6, atol=1e-7)


def test_compression_error_metric():
    """Vanilla, K=2, fp4: the metric is the mean over islands of ‖q(Δ_k) − Δ_k‖/‖Δ_k‖,
    recomputed here from the islands' parameters just before the sync."""
    cfg = dl.DiLoCoConfig(num_replicas=2, sync_period=3, compression="fp4")
    inner = optax.sgd(0.05)
    algo = dl.DiLoCo(cfg, toy_loss, inner)
    state = algo.init(make_toy(N_LAYERS, WIDTH))
    data = batches(3)
    for x in data[:2]:
        state, m = algo.step(state, x)
        assert "compression_error" not in m
    outer = toy_to_numpy(algo.outer_model(state))
    # the islands after step 3's inner update, before the sync replaces them
    isl = []
    for i in range(2):
        p = toy_to_numpy(state.island(i))
        g = __import__("tests.reference", fromlist=["np_loss_and_grad"]).np_loss_and_grad(
            p, data[2][i * 4:(i + 1) * 4].astype(np.float64))[1]
        isl.append({n: p[n] - 0.05 * g[n] for n in p})
    want = []
    for i in range(2):
        d = {n: outer[n] - isl[i][n] for n in outer}
        err = sum(np.sum((np_quantize(d[n], "fp4") - d[n]) ** 2) for n in d)
        want.append(np.sqrt(err / sum(np.sum(d[n] ** 2) for n in d)))
    state, m = algo.step(state, data[2])
    assert m["compression_error"] == pytest.approx(np.mean(want), rel=1e-4)
    assert 0.02 < m["compression_error"] < 0.34


# ---------------------------------------------------------------- topk (SparseLoCo)

# (density, chunk, bits): the tensors below are, against each chunk, multiples of it (8192
# for 64 and 4096, 100 for 100), not multiples (999, 561, 257) and smaller than it (7, 20)
TOPK = [(0.1, 64, 2), (0.25, 100, 4), (0.03, 4096, 2)]
TOPK_TENSORS = {name: TENSORS[name] for name in
                ("normal", "heavy_tailed", "zeros", "huge", "tiny", "mixed_scales", "boundaries")}
TOPK_TENSORS["two_chunks"] = rng.standard_normal(8192).astype(np.float32)


def _topk_roundtrip(codec, x, with_bound=False):
    """decode(encode(x)) (and the codec's error bound), compiled once per shape: op by op
    they dispatch dozens of small programs."""
    flat = jnp.asarray(x).reshape(-1)
    got, bound = jax.jit(lambda v: (codec.decode(codec.encode(v), v.size), codec.error_bound(v)))(flat)
    got, bound = np.asarray(got).reshape(x.shape), np.asarray(bound).reshape(x.shape)
    return (got, bound) if with_bound else got


@pytest.mark.parametrize("knobs", [TOPK[0], *(pytest.param(k, marks=pytest.mark.slow) for k in TOPK[1:])])
def test_topk_roundtrip_is_np_topk_and_within_its_bound(knobs):
    codec = C.TopK(*knobs)
    density, chunk, bits = knobs
    for name, x in TOPK_TENSORS.items():
        got, codec_bound = _topk_roundtrip(codec, x, with_bound=True)
        assert got.shape == x.shape and got.dtype == np.float32
        np.testing.assert_array_equal(got, np_topk(x, *knobs).astype(np.float32), err_msg=name)
        # at most k values per chunk arrive, and the largest |x| arrives exactly
        c = min(chunk, x.size)
        assert np.count_nonzero(got) <= max(1, round(density * c)) * -(-x.size // c)
        i = np.argmax(np.abs(x))
        assert got.reshape(-1)[i] == x.reshape(-1)[i]
        # the bound, written out here: unsent values lose all of |x|, sent ones at most half
        # a level step of the tensor's largest |x| M (plus float32 rounding)
        a, m = np.abs(x).astype(np.float64), float(np.abs(x).max())
        bound = np.maximum(a, m / (2**bits - 1)) + 1e-6 * m
        assert np.all(np.abs(got - x) <= bound), name
        assert np.all(np.abs(got - x) <= codec_bound), name
        if name == "zeros":
            assert not got.any()


def test_topk_levels_by_hand():
    # one chunk of 8, k = 4 sent (3, 2.1, 1.9, 0.9), 2 bits: m = 3, levels ±3 and ±1,
    # midpoints −2, 0, 2: 0.9 -> 1, −1.9 -> −1, 2.1 -> 3; the rest are not sent
    x = np.array([0.1, 0.9, -3.0, 0.5, -1.9, -0.2, 2.1, 0.0], np.float32)
    got = _topk_roundtrip(C.TopK(0.5, 8, 2), x)
    np.testing.assert_allclose(got, [0, 1, -3, 0, -1, 0, 3, 0], rtol=1e-7)
    # a value tiny next to m keeps its sign (1 + x/m would round to 1, the tie at level 1.5)
    x = np.array([4.0, -1e-12, 1e-12, 0.0], np.float32)
    np.testing.assert_allclose(_topk_roundtrip(C.TopK(0.75, 4, 2), x), [4, -4 / 3, 4 / 3, 0], rtol=1e-6)


@pytest.mark.parametrize("knobs,n,want", [
    # c = 4096, 3 chunks, k = round(122.88) = 123: ceil(369·2/8) = 93 code bytes,
    # 2·369 = 738 index bytes, 3·4 scale bytes
    ((0.03, 4096, 2), 10000, 93 + 738 + 12),
    # n < chunk: c = 5, k = round(2.5) = 2 (half to even): 1 byte of two 4-bit codes
    ((0.5, 64, 4), 5, 1 + 4 + 4),
    # every value, 1 bit each: 3 chunks of 3, 9 codes in 2 bytes
    ((1.0, 3, 1), 7, 2 + 18 + 12),
    # 8 bits: one byte per code
    ((0.1, 100, 8), 1000, 100 + 200 + 40),
])
def test_topk_payload_bytes(knobs, n, want):
    codec = C.TopK(*knobs)
    p = jax.jit(codec.encode)(jnp.linspace(-1, 1, n, dtype=jnp.float32))
    assert {k: v.dtype for k, v in p.items()} == {"values": jnp.uint8, "indices": jnp.uint16, "scale": jnp.float32}
    assert sum(v.nbytes for v in p.values()) == want == codec.payload_bytes(n)
    assert codec.index_bytes(n) == p["indices"].nbytes
    if knobs == (0.03, 4096, 2):  # the registered "topk" is this one
        assert C.payload_bytes(n, "topk") == want and C.get_codec("topk") == codec


def test_topk_knobs_build_the_codec():
    cfg = dl.DiLoCoConfig(compression="topk", topk_density=0.1, topk_chunk=64, topk_bits=4)
    assert cfg.codec == C.TopK(0.1, 64, 4) == C.TopK(density=0.1, chunk=64, bits=4)
    assert dl.DiLoCoConfig(compression="topk").codec == C.TopK()
    with pytest.raises(ValueError, match=r"TopK bits must be one of \(1, 2, 4, 8\); got 3"):
        C.TopK(bits=3)


def test_step_matches_reference_with_topk_and_decayed_error_feedback():
    """SparseLoCo: chunked top-k of β·e + Δ, e <- that minus what was sent, plain SGD outer
    step (β_outer = 0); Streaming with AdamW islands, so fragments cut leaves."""
    knobs = dict(num_replicas=2, sync_period=6, streaming=True, num_fragments=3, outer_lr=1.0,
                 outer_momentum=0.0, compression="topk", error_feedback=True, error_decay=0.9,
                 topk_density=0.5, topk_chunk=4, topk_bits=2)
    cfg = dl.DiLoCoConfig(**knobs)
    data = batches(18)
    losses, state = run_jax(cfg, optax.adamw(0.01, weight_decay=1e-4), data)
    model0 = toy_to_numpy(make_toy(N_LAYERS, WIDTH))
    common = dict(k=2, h=6, inner=NpAdamW(0.01), streaming=True, p=3, outer_lr=1.0, momentum=0.0)

    def reference(**kw):
        return np_run(model0, data, **common, **kw)

    ref_losses, ref_outer, ref_islands = reference(
        compression=lambda d: np_topk(d, 0.5, 4, 2), error_feedback=True, error_decay=0.9)
    np.testing.assert_allclose(losses, ref_losses, rtol=2e-5, atol=2e-5)
    outer = toy_to_numpy(state.outer)
    for name in outer:
        np.testing.assert_allclose(outer[name], ref_outer[name], rtol=2e-5, atol=2e-5)
    for i, isl in enumerate(ref_islands):
        for name, got in toy_to_numpy(state.island(i)).items():
            np.testing.assert_allclose(got, isl[name], rtol=2e-5, atol=2e-5)
    # neither the decay nor the compression is vacuous here
    for other in (dict(compression=lambda d: np_topk(d, 0.5, 4, 2), error_feedback=True),
                  dict(compression="none")):
        changed = reference(**other)[1]
        assert any(not np.allclose(changed[n], ref_outer[n], rtol=1e-4, atol=1e-6) for n in outer), other
