"""experiments/gap_trends.py: the runs it compares share their start, its step counts and
model sizes, and its gaps and slopes against hand-worked numbers."""

import jax
import numpy as np
import pytest

from experiments import gap_trends as g


def _build(flags):
    from diloco_eqx.training.runner import build
    from experiments.train import parse_settings

    return build(parse_settings([*flags, "--corpus", "markov"]))


def test_same_seed_gives_every_method_the_same_initialization_and_data_order():
    """Paired comparisons rest on this: DDP, DiLoCo and Streaming DiLoCo runs with one seed
    start from the same parameters and read the same global batches in the same order, at
    every budget (a budget changes only the step count); another seed changes both."""
    flags = {n: f for n, f in g.jobs(g.QUICK) if "size=43k" in n}
    jobs = {n: _build(f) for n, f in flags.items()}
    ref = _build([*flags["ddp,size=43k,tpp=1,seed=0"], "--seed", "1"])  # the last --seed wins
    assert len(jobs) == 6  # 3 methods × 2 budgets
    first = next(iter(jobs.values()))
    leaves = jax.tree.leaves(first.model)
    batches = [first.train_ds[i] for i in range(3)]
    for name, job in jobs.items():
        assert all(np.array_equal(a, b) for a, b in zip(leaves, jax.tree.leaves(job.model), strict=True)), name
        assert all(np.array_equal(b, job.train_ds[i]) for i, b in enumerate(batches)), name
    assert not np.array_equal(ref.train_ds[0], batches[0])
    assert not all(np.array_equal(a, b) for a, b in zip(leaves, jax.tree.leaves(ref.model), strict=True))


def test_sizes_and_steps():
    import equinox as eqx

    import diloco_eqx.models.transformer as t

    for name, (layers, width, heads, params) in g.SIZES.items():
        config = t.TransformerConfig(num_layers=layers, width=width, num_heads=heads, seq_len=64)
        model, _ = eqx.filter_eval_shape(t.build, config, jax.random.key(0))
        assert sum(x.size for x in jax.tree.leaves(model)) == params, name
    # 43,168 parameters × 4 tokens / 512 tokens per step = 337.3 steps -> 11 periods of 30
    assert [g.steps_for("43k", b) for b in g.FULL.budgets] == [330, 840, 1680, 3360]
    assert g.steps_for("10k", 20) == 420 and g.steps_for("135k", 20) == 5280
    assert g.steps_for("10k", 0.01) == 30  # at least one period
    # the size study's 43k point is the budget study's 20-tokens-per-parameter run
    assert g.FULL.points() == [("43k", 4), ("43k", 10), ("43k", 20), ("43k", 40), ("10k", 20), ("135k", 20)]
    assert len(g.jobs(g.FULL)) == 6 * 3 * len(g.FULL.seeds)


def _rows(gap_pct):
    """DDP at loss 2.0 for every seed and budget; the methods above it by gap_pct[method][seed][i] %."""
    rows = []
    for i, tpp in enumerate((1.0, 10.0, 100.0)):
        for seed in range(3):
            rows.append({"method": "ddp", "tpp": tpp, "seed": seed, "eval_loss": 2.0})
            for m, by_seed in gap_pct.items():
                rows.append({"method": m, "tpp": tpp, "seed": seed, "eval_loss": 2.0 * (1 + by_seed[seed][i] / 100)})
    return rows


def test_gaps_and_slopes_by_hand():
    # DiLoCo's gap falls by 1, 1.2 and 0.8 points per decade on the three seeds: mean slope −1,
    # sd 0.2, half-width t(0.975, 2)·0.2/√3 = 0.4968; Streaming's is flat at 0.5% with seed noise
    diloco = {0: [3.0, 2.0, 1.0], 1: [3.2, 2.0, 0.8], 2: [2.8, 2.0, 1.2]}
    streaming = {0: [0.4, 0.4, 0.4], 1: [0.5, 0.6, 0.5], 2: [0.6, 0.5, 0.6]}
    res = g.gaps(_rows({"diloco": diloco, "streaming": streaming}), "tpp")
    pt = {(p["method"], p["tpp"]): p for p in res["points"]}
    assert pt[("diloco", 1.0)]["gap_pct"] == pytest.approx(3.0)
    assert pt[("diloco", 1.0)]["verdict_within_1pct"] == "contradicted"
    # at 100: gaps 1.0, 0.8, 1.2 — mean 1.0, straddles the 1% margin
    assert pt[("diloco", 100.0)]["verdict_within_1pct"] == "unresolved"
    # Streaming at 10: 0.4, 0.6, 0.5 — mean 0.5, sd 0.1, upper end 0.5 + 4.3027·0.1/√3 = 0.748 < 1
    assert pt[("streaming", 10.0)]["hi_pct"] == pytest.approx(0.5 + 4.302653 * 0.1 / 3 ** 0.5, rel=1e-5)
    assert pt[("streaming", 10.0)]["verdict_within_1pct"] == "holding"
    trend = {t["method"]: t for t in res["trends"]}
    half = 4.302653 * 0.2 / 3 ** 0.5
    assert trend["diloco"]["slope_pct_per_decade"] == pytest.approx(-1.0)
    assert (trend["diloco"]["lo"], trend["diloco"]["hi"]) == (pytest.approx(-1 - half, rel=1e-5),
                                                               pytest.approx(-1 + half, rel=1e-5))
    assert trend["diloco"]["verdict_gap_shrinks"] == "holding"
    assert trend["streaming"]["verdict_gap_shrinks"] == "unresolved"


def test_start_spread():
    rows = [{"size": "15k", "seed": 0, "first_loss": 5.5}, {"size": "15k", "seed": 0, "first_loss": 5.5},
            {"size": "15k", "seed": 1, "first_loss": 5.2}, {"size": "43k", "seed": 0, "first_loss": 5.6}]
    assert g.start_spread(rows) == 0.0
    assert g.start_spread([*rows, {"size": "15k", "seed": 1, "first_loss": 5.25}]) == pytest.approx(0.05)
