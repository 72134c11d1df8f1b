"""Fault models: which islands miss a sync.

A fault model is a final `AbstractFaultModel` subclass: `missing(t, ids, deltas)` says, for
each island on this device (global indices `ids`), whether it misses the sync at step t.
The built-in models are built from the config's knobs — `Listed` (`drops`), `Coin`
(`drop_prob`, `fault_seed`) — and any model registered by name with `register_fault_model`
is switched on by naming it in `faults`. `Combined` misses an island when any of its parts
does. An island whose fragment holds a NaN or Inf never contributes, whatever the model:
the sync checks that itself, once per island, and the apply resets such an island.
"""

from __future__ import annotations

import abc

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Int, PyTree

from diloco_eqx._registry import Registry


class AbstractFaultModel(eqx.Module):
    """Decides which islands miss a sync."""

    @abc.abstractmethod
    def missing(self, t: Int[Array, ""], ids: Int[Array, " k"], deltas: PyTree) -> Bool[Array, " k"]:
        """For each island (global index in `ids`): does it miss the sync at step t?
        `deltas` are those islands' pseudo-gradients (leading axis over `ids`)."""


class Listed(AbstractFaultModel):
    """Island i misses the sync at step s for every listed (s, i)."""

    drops: tuple[tuple[int, int], ...] = eqx.field(static=True)

    def missing(self, t, ids, deltas):
        steps = jnp.array([s for s, _ in self.drops], jnp.int32)
        which = jnp.array([i for _, i in self.drops], jnp.int32)
        return jnp.any((steps[None, :] == t) & (which[None, :] == ids[:, None]), axis=1)


class Coin(AbstractFaultModel):
    """Island i misses each sync with probability probs[i]; the coin is drawn from the seed
    and t, so a resumed run draws the same coins."""

    probs: tuple[float, ...] = eqx.field(static=True)
    seed: int = eqx.field(static=True)

    def missing(self, t, ids, deltas):
        coin = jax.random.uniform(jax.random.fold_in(jax.random.key(self.seed), t), (len(self.probs),))
        return (coin < jnp.asarray(self.probs, jnp.float32))[ids]


class Combined(AbstractFaultModel):
    """Misses an island when any of `parts` does."""

    parts: tuple[AbstractFaultModel, ...]

    def missing(self, t, ids, deltas):
        out = jnp.zeros(ids.shape, bool)
        for part in self.parts:
            out = out | part.missing(t, ids, deltas)
        return out


MODELS: Registry[AbstractFaultModel] = Registry(
    "fault model", "an AbstractFaultModel instance", lambda m: isinstance(m, AbstractFaultModel))


def register_fault_model(name: str, model: AbstractFaultModel, *, overwrite: bool = False) -> None:
    """Make `model` available as `faults=(name,)` (and `--faults name`)."""
    MODELS.register(name, model, overwrite=overwrite)


registered_fault_models = MODELS.names


def get_fault_model(name: str) -> AbstractFaultModel:
    if name not in MODELS:
        raise ValueError(f"faults: {name!r} is not a registered fault model; registered: "
                         f"{registered_fault_models()} (add one with register_fault_model)")
    return MODELS[name]


def from_knobs(drops, probs: tuple[float, ...], seed: int, names: tuple[str, ...]) -> Combined:
    """The fault model a config describes: listed drops, the coin and named models where
    the knobs ask for them (none: no island misses a sync, but for non-finite ones)."""
    parts: list[AbstractFaultModel] = []
    if drops:
        parts.append(Listed(tuple(drops)))
    if any(p > 0 for p in probs):
        parts.append(Coin(tuple(probs), seed))
    parts.extend(get_fault_model(n) for n in names)
    return Combined(tuple(parts))
