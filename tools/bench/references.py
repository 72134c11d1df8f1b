"""What a sync is measured against: the floor of the bytes it must move, and the same sync
written by hand. Each reference is a jitted function timed on the carry its last call left
(donated, so updated in place), inside the repetitions of the steps, not once on its own."""

from __future__ import annotations

import time


class InPlaceTimer:
    """Jitted functions each called on the carry the last call left: each call times one run."""

    def __init__(self, runs: dict, carry, keep=lambda out: out):
        import jax

        self.runs, self.keep = runs, keep
        self.carry = carry
        for name in runs:  # compiled and warm
            self.carry = keep(jax.block_until_ready(runs[name](self.carry)))

    def __call__(self, name: str) -> float:
        import jax

        t0 = time.perf_counter()
        self.carry = self.keep(jax.block_until_ready(self.runs[name](self.carry)))
        return time.perf_counter() - t0


def sync_references(m, k: int, vanilla, num_fragments: int) -> tuple[int, int, dict]:
    """(bytes a vanilla sync must read, those a deferred Streaming sync must read on average,
    {name: (timer, its run)} for the floors of both and the hand-written syncs)."""
    import equinox as eqx
    import jax

    from diloco_eqx.models.transformer import count_params

    n = count_params(m)
    island_bytes = jax.tree.leaves(eqx.filter(m, eqx.is_inexact_array))[0].dtype.itemsize
    floor_bytes = (k * island_bytes + 2 * 4) * n  # K islands, outer model and momentum (float32)
    stream_bytes = deferred_sync_bytes(n, k, island_bytes, num_fragments)
    hand = handwritten_syncs(m, k, vanilla)
    return floor_bytes, stream_bytes, {"floor": (stream_floor(floor_bytes // 4), "floor"),
                                       "stream_floor": (stream_floor(stream_bytes // 8), "floor"),
                                       **{name: (hand, name) for name in hand.runs}}


def deferred_sync_bytes(n: int, k: int, island_bytes: int, num_fragments: int) -> int:
    """Bytes one deferred Streaming sync (V >= 1) must read and write, on average over the P
    fragments (together they hold the n parameters): the stash step reads each island's
    fragment and the outer one and writes the K pseudo-gradients (float32); the exchange
    reads them, the outer fragment and its momentum and writes those two; the apply reads
    each island's fragment and the outer one and writes the islands. Per parameter that is
    3·K·b_island + 2·K·4 + 6·4 bytes, where a vanilla sync at its floor moves 2·K·b_island
    + 4·4: the stash and the second read of the islands make a cycle of P Streaming syncs
    touch more than one vanilla sync does."""
    return (3 * k * island_bytes + 2 * k * 4 + 6 * 4) * n // num_fragments


def handwritten_syncs(m, k: int, cfg) -> InPlaceTimer:
    """A vanilla sync's arithmetic written by hand as one jitted function on donated arrays
    (every island finite and contributing): the mean of the K pseudo-gradients as a chain of
    adds, the outer Nesterov step, the two diagnostic norms and the new outer model written
    into every island ("by_hand"). What XLA makes of the sync without the step's schedule,
    masks and fault handling: the step's own sync is compared with it. Without the norms
    ("minimal"), the least arithmetic a sync is: what the backend can do against the floor,
    whatever the step does. Both run on one carry (K + 2 model-sized float32 buffers)."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import optax

    tx = optax.sgd(cfg.outer_lr, momentum=cfg.outer_momentum, nesterov=True)
    outer = jax.tree.map(jnp.asarray, eqx.filter(m, eqx.is_inexact_array))

    def sync(islands, outer, opt, norms: bool):
        mean = jax.tree.map(lambda o, i: o - sum(i[j] for j in range(k)) / k, outer, islands)
        update, opt = tx.update(mean, opt, outer)
        new = optax.apply_updates(outer, update)
        islands = jax.tree.map(lambda o, i: jnp.broadcast_to(o, i.shape).astype(i.dtype), new, islands)
        if not norms:
            return islands, new, opt
        return islands, new, opt, optax.tree.norm(mean), optax.tree.norm(update)  # outputs: computed

    runs = {name: jax.jit(lambda args, norms=norms: sync(*args, norms), donate_argnums=0)
            for name, norms in (("by_hand", True), ("minimal", False))}
    islands = jax.tree.map(lambda x: jnp.stack([x] * k), outer)
    return InPlaceTimer(runs, (islands, jax.tree.map(lambda x: x + 0, outer), tx.init(outer)), keep=lambda out: out[:3])


def stream_floor(values: int) -> InPlaceTimer:
    """One fused, in-place pass that reads and writes `values` float32 values ("floor"). A
    buffer of its own: over the front of a larger one, XLA:CPU would write on one thread."""
    import jax
    import jax.numpy as jnp

    touch = jax.jit(lambda x: x * 1.0000001 + 1e-9, donate_argnums=0)
    return InPlaceTimer({"floor": touch}, jnp.ones((values,), jnp.float32))
