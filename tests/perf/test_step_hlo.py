"""The compiled step's structure (read from its HLO and buffer assignment): a strided sync
needs no more temporaries than a contiguous one, the events update fragments in place, an
event's guard is one loop whatever P, and an apply reads only its fragment of the outer model."""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import diloco_eqx as dl
from diloco_eqx.analysis import comms
from tests.helpers import make_diloco
from tests.reference import make_toy, toy_loss


@pytest.mark.parametrize("v", [0, 1])
def test_strided_fragments_need_no_more_temporaries_than_contiguous(v):
    """A sync of layers that are not consecutive is taken block by block: the compiled step
    needs no more temporary memory than the same step with consecutive layers (no copy of the
    fragment for its mean, outer step or apply). The inner step does nothing, so that the sync's
    buffers are all the temporaries there are."""
    inner = optax.set_to_zero()

    def temps(order):
        cfg = dl.DiLoCoConfig(num_replicas=2, sync_period=6, streaming=True, num_fragments=3,
                              fragment_order=order, overlap_steps=v)
        algo = dl.DiLoCo(cfg, lambda model, batch: jnp.zeros(()), inner)
        state = algo.init(make_toy(8, 4096))
        return algo.lower(state, np.zeros((2, 4096), np.float32)).compile().memory_analysis().temp_size_in_bytes

    strided, contiguous = temps("interleaved"), temps("sequential")
    assert strided <= contiguous + 1024, (strided, contiguous)


EVENT_MODES = {
    "vanilla": dict(),
    "streaming_v0": dict(streaming=True, num_fragments=3),
    "streaming_v1": dict(streaming=True, num_fragments=3, overlap_steps=1),
    "delayed_naive": dict(streaming=True, num_fragments=3, delayed_outer="naive"),
    "delayed_eager_sequential": dict(streaming=True, num_fragments=3, delayed_outer="eager",
                                     fragment_order="sequential"),
}


@pytest.mark.parametrize("mode", list(EVENT_MODES))
def test_events_copy_no_island_layer_stack(mode):
    """A sync and an apply update fragments in place: the compiled events copy no array as
    large as one stacked leaf of the islands. With delayed outer updates the write of the outer
    copies and the write of the in-flight slot each read the other's values from a buffer written
    out first, so XLA finds an order for both writes in place. The inner step does nothing, so
    the events' buffers are the large ones."""
    k, layers, width = 2, 8, 4096
    cfg = dl.DiLoCoConfig(num_replicas=k, sync_period=6, **EVENT_MODES[mode])
    inner = optax.set_to_zero()
    algo = dl.DiLoCo(cfg, lambda model, batch: jnp.zeros(()), inner)
    state = algo.init(make_toy(layers, width))
    hlo = algo.lower(state, np.zeros((2, width), np.float32)).compile().as_text()
    copied = comms.event_copies(hlo)
    assert copied, "no copy at all: the HLO parse found nothing to check"
    largest = max(copied, key=lambda c: math.prod(c[1]))
    assert math.prod(largest[1]) < k * layers * width, largest


def _top_level_loops(algo, state, batch) -> int:
    """While loops the compiled step runs outside any loop: those in its entry computation
    and in the computations it calls (newer XLA wraps a top-level loop in a `call`), not
    those inside a loop's body."""
    text = algo.lower(state, batch).compile().as_text()
    bodies = dict(re.findall(r"^(?:ENTRY )?%(\S+) .*?\{\n(.*?)^\}", text, re.S | re.M))
    entry = re.search(r"^ENTRY %(\S+) ", text, re.M).group(1)

    def loops(name: str) -> int:
        lines = bodies[name].splitlines()
        called = [m.group(1) for line in lines if " call(" in line and (m := re.search(r"to_apply=%([\w.\-]+)", line))]
        return sum(" while(" in line for line in lines) + sum(loops(c) for c in called)

    return loops(entry)


@pytest.mark.parametrize("v, after_inner, want", [(0, None, 1), (1, True, 1), (1, False, 3)],
                         ids=["v0", "v1-waiting", "v1-free"])
def test_an_event_tests_one_predicate_whatever_p(v, after_inner, want):
    """A step without events tests few predicates, whatever P (XLA:GPU reads each top-level
    loop's predicate on the host): the events after the inner step sit in one guard loop
    (the sync with its checked second pass and the apply at V = 0; at V = 1 the stash and
    the apply, and the exchange with its checked second pass when it waits for the inner
    step), so 1 loop; a free exchange comes before with its second pass, so 3, for P = 2
    and 5 alike (a loop per fragment would make the count grow with P)."""
    model, inner = make_toy(4, 8), optax.adamw(1e-3)
    loops = {}
    for p in (2, 5):
        cfg = dl.DiLoCoConfig(num_replicas=2, sync_period=10, streaming=True, num_fragments=p, overlap_steps=v)
        algo = make_diloco(cfg, inner, exchange_after_inner=after_inner)
        loops[p] = _top_level_loops(algo, algo.init(model), np.zeros((4, 8), np.float32))
    assert loops == {2: want, 5: want}, loops


def test_an_apply_reads_only_its_fragment_of_the_outer_model():
    """The apply's loop body reads the outer fragment through a trip-dependent zero
    (`when(zero=True)`), so no select copies the whole outer layer stack on an apply: the
    only whole-stack selects left in the apply are inside the reset's own event (run only
    when an island is reset)."""
    model, inner = make_toy(4, 8), optax.adamw(1e-3)
    cfg = dl.DiLoCoConfig(num_replicas=2, sync_period=9, streaming=True, num_fragments=3, overlap_steps=1)
    algo = dl.DiLoCo(cfg, toy_loss, inner)
    text = algo.lower(algo.init(model), np.zeros((4, 8), np.float32)).compile().as_text()
    stack = {"f32[" + ",".join(map(str, x.shape)) + "]" for x in jax.tree.leaves(model.layers)}
    selects = []
    for line in text.splitlines():
        shape, name = re.search(r"= (\w+\[[\d,]*\])", line), re.search(r'op_name="([^"]*)"', line)
        if shape and name and shape.group(1) in stack and "/diloco_apply/" in name.group(1) \
                and name.group(1).endswith("jit(_where)/select_n") and "vmap(jit(_where))" not in name.group(1):
            selects.append(name.group(1).count("schedule_event"))
    # 3: the reset's event inside the apply's, inside the guard of the events after the inner step
    assert selects and set(selects) == {3}, selects
