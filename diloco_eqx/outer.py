"""Outer optimizers by name: how the outer model steps on the mean pseudo-gradient Δ.

`DiLoCoConfig.outer_optimizer` names one; each is a function of the config returning an
optax transformation (one state per fragment is kept by the step). Built in:

- "nesterov" (default): SGD with Nesterov momentum, v <- Δ + βv, θ <- θ - η(Δ + βv);
- "adam": θ <- θ - η·m̂/(√v̂ + 1e-8) with m, v Adam's bias-corrected moments of Δ
  (β1 = outer_momentum, β2 = outer_b2);
- "average": θ <- θ - Δ, i.e. the outer model becomes the mean of the islands (plain model
  averaging; outer_lr and outer_momentum are not read).

`register_outer_optimizer(name, fn)` adds one: `fn(cfg) -> optax.GradientTransformation`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import optax

from diloco_eqx._registry import Registry

OuterOptimizer = Callable[[Any], optax.GradientTransformation]

OUTER_OPTIMIZERS: Registry[OuterOptimizer] = Registry(
    "outer_optimizer", "a function cfg -> optax.GradientTransformation", callable)


def nesterov(cfg) -> optax.GradientTransformation:
    return optax.sgd(cfg.outer_lr, momentum=cfg.outer_momentum, nesterov=True)


def adam(cfg) -> optax.GradientTransformation:
    return optax.adam(cfg.outer_lr, b1=cfg.outer_momentum, b2=cfg.outer_b2, eps=1e-8)


def average(cfg) -> optax.GradientTransformation:
    return optax.sgd(1.0)


for _name, _fn in (("nesterov", nesterov), ("adam", adam), ("average", average)):
    OUTER_OPTIMIZERS.register(_name, _fn)


def register_outer_optimizer(name: str, fn: OuterOptimizer, *, overwrite: bool = False) -> None:
    """Make `fn(cfg) -> optax.GradientTransformation` selectable as outer_optimizer=name."""
    OUTER_OPTIMIZERS.register(name, fn, overwrite=overwrite)


def registered_outer_optimizers() -> tuple[str, ...]:
    return OUTER_OPTIMIZERS.names()


def check_outer_optimizer(name: str) -> None:
    if name not in OUTER_OPTIMIZERS:
        raise ValueError(f"outer_optimizer must be one of {registered_outer_optimizers()} (or a "
                         f"name given to register_outer_optimizer); got {name!r}")


def make_outer_optimizer(cfg) -> optax.GradientTransformation:
    """The outer optimizer `cfg.outer_optimizer` names, built from the config's knobs."""
    check_outer_optimizer(cfg.outer_optimizer)
    return OUTER_OPTIMIZERS[cfg.outer_optimizer](cfg)
