"""Fragment orders: how the N stacked layers are dealt out to fragments 1..P-1.

An order is a function ``(num_layers, num_fragments) -> tuple of P-1 index tuples``; entry
i-1 holds the layer indices of fragment i. Register your own with `register_order` and
name it in `DiLoCoConfig(fragment_order=...)`, or pass the function itself.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from diloco_eqx._registry import Registry

Order = Callable[[int, int], Sequence[Sequence[int]]]


def interleaved(num_layers: int, num_fragments: int) -> tuple[tuple[int, ...], ...]:
    """Fragment i owns layers i-1, i-1+(P-1), i-1+2(P-1), ... (a stride over depth)."""
    groups = num_fragments - 1
    return tuple(tuple(range(i, num_layers, groups)) for i in range(groups))


def sequential(num_layers: int, num_fragments: int) -> tuple[tuple[int, ...], ...]:
    """Fragment i owns the contiguous block [(i-1)·m, i·m), m = N/(P-1)."""
    m = num_layers // (num_fragments - 1)
    return tuple(tuple(range(i * m, (i + 1) * m)) for i in range(num_fragments - 1))


ORDERS: Registry[Order] = Registry("fragment_order", "a callable", callable)
ORDERS.register("interleaved", interleaved)
ORDERS.register("sequential", sequential)


def register_order(name: str, fn: Order, *, overwrite: bool = False) -> None:
    """Make `fn` available as `fragment_order=name`."""
    ORDERS.register(name, fn, overwrite=overwrite)


def registered_orders() -> tuple[str, ...]:
    return tuple(sorted(ORDERS.names()))


def resolve_order(order: str | Order) -> Order:
    """The order function for a name or callable; ValueError naming the knob otherwise."""
    if callable(order):
        return order
    if order not in ORDERS:
        raise ValueError(
            f"fragment_order must be one of {registered_orders()} or a callable "
            f"(num_layers, num_fragments) -> index tuples; got {order!r}"
        )
    return ORDERS[order]


def layer_groups(
    order: str | Order, num_layers: int, num_fragments: int
) -> tuple[tuple[int, ...], ...]:
    """Run an order and check it returns P-1 disjoint sorted groups covering 0..N-1."""
    name = order if isinstance(order, str) else getattr(order, "__name__", repr(order))
    if num_fragments < 2:
        raise ValueError(f"num_fragments (P) must be >= 2 to split layers; got {num_fragments}")
    if num_layers % (num_fragments - 1):
        raise ValueError(
            f"num_fragments (P) - 1 must divide the number of layers: {num_layers} layers "
            f"cannot be split into P-1={num_fragments - 1} fragments; choose P-1 among "
            f"{[d for d in range(1, num_layers + 1) if num_layers % d == 0]}"
        )
    raw = resolve_order(order)(num_layers, num_fragments)
    try:
        groups = tuple(tuple(sorted(int(i) for i in g)) for g in raw)
    except TypeError as e:
        raise ValueError(
            f"fragment_order {name!r} must return a sequence of index sequences; got {raw!r}"
        ) from e
    if len(groups) != num_fragments - 1:
        raise ValueError(
            f"fragment_order {name!r} returned {len(groups)} groups; expected P-1 = "
            f"{num_fragments - 1}"
        )
    flat = [i for g in groups for i in g]
    bad = [i for i in flat if not 0 <= i < num_layers]
    if bad:
        raise ValueError(
            f"fragment_order {name!r} returned layer indices {bad} outside 0..{num_layers - 1}"
        )
    if len(set(flat)) != len(flat):
        dup = sorted({i for i in flat if flat.count(i) > 1})
        raise ValueError(
            f"fragment_order {name!r} must return disjoint groups; layers {dup} appear twice"
        )
    if len(flat) != num_layers:
        missing = sorted(set(range(num_layers)) - set(flat))
        raise ValueError(
            f"fragment_order {name!r} must cover every layer 0..{num_layers - 1}; "
            f"missing {missing}"
        )
    if any(len(g) == 0 for g in groups):
        raise ValueError(f"fragment_order {name!r} returned an empty fragment")
    return groups
