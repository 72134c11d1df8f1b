"""Fragment orders: docs/algorithm.md's definitions, registration, and validation of user orders."""

import pytest

import diloco_eqx as dl
from diloco_eqx.orders import interleaved, layer_groups, sequential


@pytest.mark.parametrize("n,p", [(4, 3), (6, 4), (12, 5), (8, 2), (6, 7)])
def test_builtin_orders_follow_spec(n, p):
    m = n // (p - 1)
    assert interleaved(n, p) == tuple(
        tuple(l for l in range(n) if l % (p - 1) == i - 1) for i in range(1, p))
    assert sequential(n, p) == tuple(tuple(range((i - 1) * m, i * m)) for i in range(1, p))
    assert interleaved(6, 4) == ((0, 3), (1, 4), (2, 5)) and sequential(6, 4) == ((0, 1), (2, 3), (4, 5))


def test_register_user_order():
    def reverse_depth(n, p):
        return tuple(tuple(reversed(g)) for g in reversed(sequential(n, p)))

    dl.register_order("test_reverse_depth", reverse_depth)
    assert "test_reverse_depth" in dl.registered_orders()
    assert layer_groups("test_reverse_depth", 6, 4) == ((4, 5), (2, 3), (0, 1))
    cfg = dl.DiLoCoConfig(streaming=True, num_fragments=4, sync_period=12,
                          fragment_order="test_reverse_depth")
    assert cfg.fragment_order == "test_reverse_depth"
    with pytest.raises(ValueError, match="already registered"):
        dl.register_order("test_reverse_depth", interleaved)
    dl.register_order("test_reverse_depth", interleaved, overwrite=True)


BAD_ORDERS = [
    (lambda n, p: ((0, 1), (1, 2), (3, 4), (5,)), "returned 4 groups; expected P-1 = 3"),
    (lambda n, p: ((0, 1), (1, 2), (3, 4)), r"disjoint groups; layers \[1\] appear twice"),
    (lambda n, p: ((0, 1), (2, 3), (4, 6)), r"layer indices \[6\] outside 0..5"),
    (lambda n, p: ((0,), (2, 3), (4, 5)), r"cover every layer 0..5; missing \[1\]"),
    (lambda n, p: 5, "must return a sequence of index sequences"),
]


@pytest.mark.parametrize("fn,match", BAD_ORDERS)
def test_bad_user_orders_are_rejected(fn, match):
    with pytest.raises(ValueError, match="fragment_order .*" + match):
        layer_groups(fn, 6, 4)


def test_layers_not_divisible_by_p_minus_one():
    with pytest.raises(ValueError, match=r"num_fragments \(P\) - 1 must divide the number of layers: 6 layers .*P-1=4"):
        layer_groups("interleaved", 6, 5)


def test_register_rejects_non_callables():
    with pytest.raises(ValueError, match="expected a callable"):
        dl.register_order("bad", 3)
