"""An independent NumPy reading of docs/algorithm.md, and the small model both sides train.

Nothing here imports diloco_eqx: islands are a Python list of dicts of float64 arrays,
gradients are written out by hand, and the schedule, fragments, Nesterov step and blend
are re-derived from docs/algorithm.md's formulas.
"""

from __future__ import annotations

import dataclasses

import equinox as eqx
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jaxtyping import Array, Float, Int

# ---------------------------------------------------------------- the toy model (JAX side)


class ToyLayer(eqx.Module):
    w: Float[Array, " d"]
    b: Float[Array, " d"]


class Toy(eqx.Module):
    """A model with non-stacked leaves (embed, head), a layer stack and an int leaf."""

    embed: Float[Array, " d"]
    layers: ToyLayer
    head: Float[Array, " d"]
    calls: Int[Array, ""]  # not a parameter: must pass through DiLoCo untouched


def make_toy(num_layers: int, width: int, seed: int = 0, dtype=jnp.float32) -> Toy:
    rng = np.random.default_rng(seed)
    f = lambda *s: jnp.asarray(rng.normal(size=s), dtype)  # noqa: E731
    return Toy(
        embed=f(width),
        layers=ToyLayer(w=f(num_layers, width), b=f(num_layers, width)),
        head=f(width),
        calls=jnp.array(7, jnp.int32),
    )


def toy_loss(model: Toy, x: Float[Array, "B d"]) -> Float[Array, ""]:
    """Mean over rows of 0.5‖e−x‖² + 0.5‖h⊙e−1‖² + Σ_l 0.5‖w_l⊙x−(l+1)‖² + 0.5‖b_l−2x‖²."""
    n = model.layers.w.shape[0]
    c = jnp.arange(1, n + 1, dtype=jnp.float32)[:, None, None]
    f32 = lambda a: a.astype(jnp.float32)  # noqa: E731 - any storage dtype computes in float32
    e, h = f32(model.embed)[None], f32(model.head)[None]
    w, b = f32(model.layers.w)[:, None], f32(model.layers.b)[:, None]
    per_row = (
        0.5 * jnp.sum((e - x) ** 2, -1)
        + 0.5 * jnp.sum((h * e - 1.0) ** 2, -1)
        + 0.5 * jnp.sum((w * x[None] - c) ** 2, (0, 2))
        + 0.5 * jnp.sum((b - 2.0 * x[None]) ** 2, (0, 2))
    )
    return jnp.mean(per_row)


def toy_to_numpy(model: Toy) -> dict[str, np.ndarray]:
    return {
        "embed": np.asarray(model.embed, np.float64),
        "w": np.asarray(model.layers.w, np.float64),
        "b": np.asarray(model.layers.b, np.float64),
        "head": np.asarray(model.head, np.float64),
    }


# ---------------------------------------------------------------- the NumPy reference

STACKED = ("w", "b")
UNSTACKED = ("embed", "head")


def np_loss_and_grad(p: dict, x: np.ndarray) -> tuple[float, dict]:
    e, h, w, b = p["embed"], p["head"], p["w"], p["b"]
    n = w.shape[0]
    c = np.arange(1, n + 1, dtype=np.float64)[:, None, None]
    r_e = e[None] - x
    r_he = h[None] * e[None] - 1.0
    r_w = w[:, None] * x[None] - c
    r_b = b[:, None] - 2.0 * x[None]
    loss = (
        0.5 * (r_e**2).sum(-1) + 0.5 * (r_he**2).sum(-1)
        + 0.5 * (r_w**2).sum((0, 2)) + 0.5 * (r_b**2).sum((0, 2))
    ).mean()
    grads = {
        "embed": (r_e + r_he * h[None]).mean(0),
        "head": (r_he * e[None]).mean(0),
        "w": (r_w * x[None]).mean(1),
        "b": r_b.mean(1),
    }
    return float(loss), grads


def cast(x, dtype):
    """A float64 copy of x rounded to `dtype` (None: not rounded)."""
    if dtype is None:
        return np.array(x, np.float64)
    return np.asarray(x).astype(dtype).astype(np.float64)


@dataclasses.dataclass
class NpSGD:
    """optax.sgd; with `dtype`, the rounding optax does on parameters stored in that dtype:
    the gradient, −lr·g (lr cast to the dtype first) and p + u each rounded to it."""

    lr: float
    dtype: object = None

    def init(self, p):
        return None

    def step(self, p, g, s):
        d = self.dtype
        if d is None:
            return {k: p[k] - self.lr * g[k] for k in p}, s
        return {k: cast(p[k] + cast(cast(-self.lr, d) * cast(g[k], d), d), d) for k in p}, s

    def reset(self, s, p):
        return s


@dataclasses.dataclass
class NpAdamW:
    """optax.adamw's formula: bias-corrected moments, decoupled weight decay."""

    lr: float
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 1e-4

    def init(self, p):
        return {"t": 0, "m": {k: np.zeros_like(v) for k, v in p.items()},
                "v": {k: np.zeros_like(v) for k, v in p.items()}}

    def step(self, p, g, s):
        t = s["t"] + 1
        m = {k: self.b1 * s["m"][k] + (1 - self.b1) * g[k] for k in p}
        v = {k: self.b2 * s["v"][k] + (1 - self.b2) * g[k] ** 2 for k in p}
        new = {}
        for k in p:
            mh, vh = m[k] / (1 - self.b1**t), v[k] / (1 - self.b2**t)
            new[k] = p[k] - self.lr * (mh / (np.sqrt(vh) + self.eps) + self.weight_decay * p[k])
        return new, {"t": t, "m": m, "v": v}

    def reset(self, s, p):
        """A moment that holds a NaN or Inf starts again from zero; the step count stays."""
        fix = lambda d: {k: v if np.all(np.isfinite(v)) else np.zeros_like(v) for k, v in d.items()}  # noqa: E731
        return {"t": s["t"], "m": fix(s["m"]), "v": fix(s["v"])}


@dataclasses.dataclass
class NpNesterov:
    """optax.sgd(lr, momentum, nesterov=True): v <- g + βv, p <- p - lr·(g + βv). With
    `dtype` the trace is stored in it, and β meets the stored trace rounded to it."""

    lr: float
    momentum: float
    dtype: object = None

    def init(self, p):
        return {n: np.zeros_like(v) for n, v in p.items()}

    def step(self, p, g, s):
        new_trace = {n: g[n] + cast(self.momentum, self.dtype) * s[n] for n in p}
        new = {n: p[n] - self.lr * (g[n] + self.momentum * new_trace[n]) for n in p}
        return new, {n: cast(v, self.dtype) for n, v in new_trace.items()}


@dataclasses.dataclass
class NpScheduledSGD:
    """optax.sgd(schedule): p <- p - schedule(count)·g, count starting at 0."""

    schedule: object

    def init(self, p):
        return {"count": 0}

    def step(self, p, g, s):
        lr = self.schedule(s["count"])
        return {n: p[n] - lr * g[n] for n in p}, {"count": s["count"] + 1}


def np_fragment_layers(order, n: int, p: int) -> list[list[int]]:
    """Layer indices of fragments 1..P-1, straight from the algorithm's definitions (a
    user's order, a callable, gives them itself)."""
    if callable(order):
        return [list(g) for g in order(n, p)]
    if order == "interleaved":
        return [[l for l in range(n) if l % (p - 1) == i - 1] for i in range(1, p)]
    m = n // (p - 1)
    return [[l for l in range(n) if l // m == i - 1] for i in range(1, p)]


def np_fragments(model0: dict, streaming: bool, h: int, p: int, order: str):
    """(Δh, H_eff, masks): masks(f) maps each leaf to the index of fragment f's entries in
    it, or None where f owns none of it."""
    if not streaming:
        return h, h, lambda f: {n: slice(None) for n in model0}
    dh = max(1, round(h / p))
    groups = np_fragment_layers(order, model0["w"].shape[0], p)

    def masks(f):
        if f == 0:
            return {n: (slice(None) if n in UNSTACKED else None) for n in model0}
        return {n: (groups[f - 1] if n in STACKED else None) for n in model0}

    return dh, p * dh, masks


def np_run(
    model0: dict,
    batches: list[np.ndarray],
    *,
    k: int,
    h: int,
    inner,
    streaming: bool = False,
    p: int = 1,
    order: str = "interleaved",
    v: int = 0,
    alpha: float = 0.0,
    outer_lr: float = 0.7,
    momentum: float = 0.9,
    compression="none",
    error_feedback: bool = False,
    error_decay: float = 1.0,
    dropped=None,
    dtype=None,
    outer_dtype: str = "float32",
    outer_opt=None,
    speeds=None,
    weighting: str = "uniform",
    log: dict | None = None,
):
    """Run the algorithm; returns (per-step island losses, outer params, islands).

    With `compression`, each island's pseudo-gradient of a leaf's fragment part goes through
    `np_quantize` (plus its carried residual, times `error_decay`, with `error_feedback`)
    before the mean.
    `dropped(t, i)` says island i misses the sync at t; an island whose pseudo-gradient
    holds a NaN or Inf misses it too. The mean is over the others; with none, no outer step.
    At an apply, an island whose fragment holds a NaN or Inf is reset: it takes the whole
    outer model and `inner.reset` its optimizer state.
    `dtype` is the islands' storage dtype (None: float64 throughout); the outer model and
    trace are then float32 (`outer_dtype="float32"`) or `dtype` ("param").
    `outer_opt` (default: Nesterov SGD from `outer_lr`, `momentum`) steps the outer model;
    each fragment has its own state, made by `outer_opt.init` on that fragment's part.
    `compression` is a format name or a function giving what the others receive for a tensor.
    `speeds` (inner steps per period of each island, default all) idles island i on the
    last H_eff − speeds[i] steps of every period; `weighting="tokens"` weights each island's
    pseudo-gradient by the steps it took since the fragment's last sync (`np_tokens`)."""
    odt = None if dtype is None else (np.float32 if outer_dtype == "float32" else dtype)
    islands = [{n: cast(a, dtype) for n, a in model0.items()} for _ in range(k)]
    residual = [{n: np.zeros_like(a) for n, a in model0.items()} for _ in range(k)]
    states = [inner.init(isl) for isl in islands]
    outer = {n: cast(a, odt) for n, a in model0.items()}
    outer_opt = NpNesterov(outer_lr, momentum, odt) if outer_opt is None else outer_opt
    outer_states = {}  # fragment -> its outer optimizer state
    dh, heff, masks = np_fragments(model0, streaming, h, p, order)
    losses, contributed, resets = [], [], []
    for step_idx, x in enumerate(batches):
        t = step_idx + 1
        losses.append(_inner_steps(islands, states, inner, x, t, heff, speeds))
        # with V >= 1 a reset island takes the outer model without this step's sync
        reset_from = {n: o.copy() for n, o in outer.items()} if streaming and v else outer
        if t > 0 and t % dh == 0:  # sync
            f = (t % heff) // dh
            owned = {n: idx for n, idx in masks(f).items() if idx is not None}
            present = [
                i for i in range(k)
                if not (dropped and dropped(t, i))
                and all(np.all(np.isfinite(outer[n][idx] - islands[i][n][idx])) for n, idx in owned.items())
            ]
            w = np_tokens(speeds, k, heff, t) if weighting == "tokens" else [1.0] * k
            present = [i for i in present if w[i] > 0]
            if present:
                delta = {n: sum(w[i] * _sent(outer[n][idx] - islands[i][n][idx], residual[i][n], idx,
                                             compression, error_feedback, error_decay) for i in present)
                         / sum(w[i] for i in present) for n, idx in owned.items()}
                part = {n: outer[n][idx] for n, idx in owned.items()}
                if f not in outer_states:
                    outer_states[f] = outer_opt.init(part)
                new, outer_states[f] = outer_opt.step(part, delta, outer_states[f])
                for n, idx in owned.items():
                    outer[n][idx] = cast(new[n], odt)
            contributed.append((t, len(present)))
        ta = t - (v if streaming else 0)
        if ta > 0 and ta % dh == 0:  # apply
            a = alpha if streaming else 0.0
            owned = {n: idx for n, idx in masks((ta % heff) // dh).items() if idx is not None}
            for i, isl in enumerate(islands):
                if not all(np.all(np.isfinite(isl[n][idx])) for n, idx in owned.items()):
                    islands[i] = {n: cast(o, dtype) for n, o in reset_from.items()}
                    states[i] = inner.reset(states[i], islands[i])
                    resets.append((t, i))
                    continue
                for n, idx in owned.items():
                    isl[n][idx] = cast(outer[n][idx] if a == 0 else a * isl[n][idx] + (1 - a) * outer[n][idx], dtype)
    if log is not None:
        # (t, islands in the mean) per sync; (t, island) per reset
        log.update(contributed=contributed, outer_states=outer_states, resets=resets)
    return np.array(losses), outer, islands


def _inner_steps(islands, states, inner, x, t: int, heff: int, speeds) -> list[float]:
    """Step t's inner step on every island (in place), island i on the i-th block of x's rows;
    with `speeds`, island i idles unless (t − 1) mod H_eff < speeds[i]. Returns the losses."""
    losses = []
    for i, rows in enumerate(np.split(x.astype(np.float64), len(islands))):
        loss, g = np_loss_and_grad(islands[i], rows)
        if speeds is None or (t - 1) % heff < speeds[i]:
            islands[i], states[i] = inner.step(islands[i], g, states[i])
        losses.append(loss)
    return losses


def np_tokens(speeds, k: int, heff: int, t: int) -> list[float]:
    """Inner steps each island took in steps max(1, t − H_eff + 1)..t, counted one by one."""
    speeds = [heff] * k if speeds is None else speeds
    return [float(sum((j - 1) % heff < speeds[i] for j in range(max(1, t - heff + 1), t + 1))) for i in range(k)]


def np_run_delayed(model0: dict, batches: list[np.ndarray], *, k: int, h: int, inner, mode: str,
                   delay: int = 1, streaming: bool = False, p: int = 1, order: str = "interleaved",
                   alpha: float = 0.0, outer_opt=None, speeds=None, weighting: str = "uniform",
                   dropped=None):
    """Delayed outer updates (`mode` "naive" or "eager"), float64 throughout; returns (per-step
    island losses, the mean of the islands' outer copies, the islands' outer copies).

    Each island keeps its own outer model and outer optimizer state per fragment. At the
    r-th sync of fragment f, with Δ_i island i's pseudo-gradient against its own copy and
    m(r) the (weighted) mean over the islands present, island i steps its copy on
    naive: m(r − d); eager: e_i·Δ_i(r) + m(r − d) − w_i(r − d)·Δ_i(r − d), where w_i(r) is
    its weight in m(r) (0 when absent) and e_i its share of all islands' weights; m and
    w of rounds before the first are 0. Then every island takes its own copy's fragment."""
    islands = [{n: a.copy() for n, a in model0.items()} for _ in range(k)]
    states = [inner.init(isl) for isl in islands]
    outers = [{n: a.copy() for n, a in model0.items()} for _ in range(k)]
    outer_opt = NpNesterov(0.7, 0.9, None) if outer_opt is None else outer_opt
    outer_states = [{} for _ in range(k)]
    history = {}  # (fragment, round) -> (mean, [w_i·Δ_i per island])
    dh, heff, masks = np_fragments(model0, streaming, h, p, order)
    losses = []
    for step_idx, x in enumerate(batches):
        t = step_idx + 1
        losses.append(_inner_steps(islands, states, inner, x, t, heff, speeds))
        if t % dh:
            continue
        f, r = (t % heff) // dh, t // heff
        owned = {n: idx for n, idx in masks(f).items() if idx is not None}
        deltas = [{n: outers[i][n][idx] - islands[i][n][idx] for n, idx in owned.items()} for i in range(k)]
        w = np_tokens(speeds, k, heff, t) if weighting == "tokens" else [1.0] * k
        present = [i for i in range(k) if w[i] > 0 and not (dropped and dropped(t, i))]
        total = sum(w[i] for i in present)
        mean = {n: sum(w[i] * deltas[i][n] for i in present) / total if present else 0 * deltas[0][n] for n in owned}
        shares = [{n: (w[i] / total if i in present else 0.0) * deltas[i][n] for n in owned} for i in range(k)]
        history[f, r] = (mean, shares)
        old_mean, old_shares = history.get((f, r - delay), (None, None))
        for i in range(k):
            step_on = {}
            for n in owned:
                arrived = 0.0 if old_mean is None else old_mean[n] - (old_shares[i][n] if mode == "eager" else 0.0)
                fresh = w[i] / sum(w) * deltas[i][n] if mode == "eager" else 0.0
                step_on[n] = fresh + arrived
            part = {n: outers[i][n][idx] for n, idx in owned.items()}
            if f not in outer_states[i]:
                outer_states[i][f] = outer_opt.init(part)
            new, outer_states[i][f] = outer_opt.step(part, step_on, outer_states[i][f])
            for n, idx in owned.items():
                outers[i][n][idx] = new[n]
                islands[i][n][idx] = outers[i][n][idx] if alpha == 0 else (
                    alpha * islands[i][n][idx] + (1 - alpha) * outers[i][n][idx])
    consensus = {n: np.mean([o[n] for o in outers], axis=0) for n in model0}
    return np.array(losses), consensus, outers


def _sent(delta, residual_leaf, idx, compression, error_feedback, decay=1.0):
    """What one island sends for one leaf's part: its pseudo-gradient, quantized (plus the
    carried error times `decay` with error feedback, whose new value is written into
    `residual_leaf`)."""
    if compression == "none":
        return delta
    if error_feedback:
        delta = delta + decay * residual_leaf[idx]
    q = compression(delta) if callable(compression) else np_quantize(delta, compression)
    if error_feedback:
        residual_leaf[idx] = delta - q
    return q


FP4_LEVELS = np.array([0.0] + [2.0**e for e in range(-6, 1)])


def np_quantize(x: np.ndarray, fmt: str) -> np.ndarray:
    """What the other islands receive for tensor x, computed without the codec: nearest
    representable value by exhaustive search (fp4) or an ml_dtypes cast (bf16, fp8; fp8's
    scale is float32 max |x| times float32 1/448)."""
    x32 = np.asarray(x, np.float32)
    if fmt == "bf16":
        return x32.astype(ml_dtypes.bfloat16).astype(np.float64)
    m = float(np.max(np.abs(x32))) if x32.size else 0.0
    if fmt == "fp8":
        s = np.float32(m) * np.float32(1 / 448.0) if m > 0 else np.float32(1.0)
        return (x32 / s).astype(ml_dtypes.float8_e4m3fn).astype(np.float32).astype(np.float64) * s
    assert fmt == "fp4", fmt
    s = np.float32(m) if m > 0 else np.float32(1.0)
    a = np.abs(x32 / s).astype(np.float64)
    dist = np.abs(a[..., None] - FP4_LEVELS)
    # nearest level; on a tie the larger one (the last of the minima)
    best = FP4_LEVELS.size - 1 - np.argmin(dist[..., ::-1], axis=-1)
    return np.sign(x32) * FP4_LEVELS[best] * np.float64(s)


def np_topk(x: np.ndarray, density: float, chunk: int, bits: int) -> np.ndarray:
    """What the other islands receive for tensor x from SparseLoCo's chunked top-k, computed
    without the codec: x (as float32, flattened) in chunks of c = min(chunk, n), the last
    padded with zeros; in each, the k = max(1, round(density·c)) largest |x| (a stable
    argsort, so the lower position wins a tie) become the nearest of the 2^bits levels
    m·(2j − (2^bits − 1))/(2^bits − 1), m their largest |x| (exhaustive search; a tie goes
    to the even j); everything else is 0."""
    x32 = np.asarray(x, np.float32)
    flat = x32.reshape(-1)
    n = flat.size
    c = max(1, min(chunk, n))
    k = max(1, round(density * c))
    chunks = -(-n // c)
    rows = np.zeros(chunks * c, np.float32)
    rows[:n] = flat
    rows = rows.reshape(chunks, c)
    top = 2**bits - 1
    ratios = np.float32(2 * np.arange(top + 1) - top) / np.float32(top)  # float32, as sent
    out = np.zeros_like(rows)
    for r, row in enumerate(rows):
        keep = np.argsort(-np.abs(row), kind="stable")[:k]
        m = np.max(np.abs(row[keep]))
        levels = (m * ratios).astype(np.float32)
        dist = np.abs(row[keep].astype(np.float64)[:, None] - levels.astype(np.float64)[None])
        best = np.argmin(dist, axis=1)  # the lower j of a tie...
        upper = np.minimum(best + 1, top)
        tie = (best < top) & (dist[np.arange(k), upper] == dist[np.arange(k), best])
        best = np.where(tie & (best % 2 == 1), upper, best)  # ...unless the upper one is even
        out[r, keep] = levels[best]
    return out.reshape(-1)[:n].reshape(x32.shape).astype(np.float64)
