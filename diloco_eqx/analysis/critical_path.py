"""Is the sync's collective on the critical path? Data dependencies in the traced step.

`analyze(closed_jaxpr)` walks the step's program — through shard_map, jit, cond/switch
branches, while-loop bodies and custom derivatives, variable by variable — and records for
every equation the set of equations it depends on. Loops are treated as a whole: each of
their outputs depends on all of their inputs; the equations in a while loop's body (the
schedule's events are loops of zero or one trip) are walked with every input of the loop.
Two questions then have exact answers:

- does a cross-island operation depend on anything in the "inner_step" scope (the
  forward, backward and AdamW update of the islands in the same step)?
- does anything in the "inner_step" scope depend on a cross-island collective?

With the direct form both the sync's collective and the next inner step wait on each other
through the data; with the deferred exchange (streaming, V >= 1) neither does.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

from diloco_eqx.islands import ACROSS

COLLECTIVES = ("psum", "pmean", "all_gather", "all_to_all", "ppermute", "reduce_scatter", "pmax", "pmin")
ACROSS_SCOPE = ACROSS
"""The named scope every backend's cross-island operation runs in: under plain jit (drjax)
the program has no collective primitives, only the operations GSPMD turns into collectives
(drjax's `sum_from_diloco`, a gather's sharding constraint)."""
INNER_SCOPE = "inner_step"


@dataclasses.dataclass(frozen=True)
class Node:
    id: int
    primitive: str
    scope: str
    """The full name stack (named scopes of every enclosing level)."""


@dataclasses.dataclass
class Analysis:
    nodes: list[Node]
    ancestors: dict[int, frozenset[int]]
    """node id -> ids of every node it depends on through data (transitively)."""

    def collectives(self) -> list[Node]:
        """Cross-island operations: collective primitives, or anything in the backends'
        `across_islands` scope."""
        return [n for n in self.nodes if n.primitive.startswith(COLLECTIVES) or _has_scope(n.scope, ACROSS_SCOPE)]

    def in_scope(self, scope: str) -> set[int]:
        return {n.id for n in self.nodes if _has_scope(n.scope, scope)}

    def collective_depends_on_inner_step(self) -> dict[int, int]:
        """For each collective: how many inner-step equations it depends on."""
        inner = self.in_scope(INNER_SCOPE)
        return {c.id: len(self.ancestors[c.id] & inner) for c in self.collectives()}

    def inner_step_depends_on_collective(self) -> set[int]:
        """Inner-step equations that depend on some collective (empty: off the critical path)."""
        coll = {c.id for c in self.collectives()}
        return {i for i in self.in_scope(INNER_SCOPE) if self.ancestors[i] & coll}


def _has_scope(stack: str, scope: str) -> bool:
    return scope in stack.split("/")


def _sub_jaxprs(eqn) -> list[tuple[Any, list]]:
    """(inner jaxpr, the outer operands bound to its invars) for each sub-program."""
    p, name = eqn.params, eqn.primitive.name
    if name == "cond":
        return [(b.jaxpr, list(eqn.invars[1:])) for b in p["branches"]]
    if name == "while":  # None: every input of the body depends on every operand
        return [(p["body_jaxpr"].jaxpr, None)]
    for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        if key in p and name != "scan":
            j = p[key]
            return [(getattr(j, "jaxpr", j), list(eqn.invars))]
    return []


def analyze(closed_jaxpr) -> Analysis:
    counter = itertools.count()
    nodes: list[Node] = []
    ancestors: dict[int, frozenset[int]] = {}

    def deps_of(atom, env) -> frozenset[int]:
        return env.get(atom, frozenset()) if hasattr(atom, "aval") and not _is_literal(atom) else frozenset()

    def walk(jaxpr, in_deps: list[frozenset[int]], prefix: str) -> list[frozenset[int]]:
        env = dict(zip(jaxpr.invars, in_deps))
        for eqn in jaxpr.eqns:
            scope = "/".join(x for x in (prefix, str(eqn.source_info.name_stack)) if x)
            operands = [deps_of(v, env) for v in eqn.invars]
            subs = _sub_jaxprs(eqn)
            nid = next(counter)
            node = Node(nid, eqn.primitive.name, scope)
            nodes.append(node)
            every = frozenset().union(*operands) if operands else frozenset()
            ancestors[nid] = every
            if subs:
                outs = [frozenset()] * len(eqn.outvars)
                if eqn.primitive.name == "cond":  # the branch index decides every output
                    outs = [operands[0]] * len(eqn.outvars)
                if eqn.primitive.name == "while":  # zero trips pass the operands through
                    outs = [every] * len(eqn.outvars)
                for sub, bound in subs:
                    ins = [every] * len(sub.invars) if bound is None else [deps_of(v, env) for v in bound]
                    res = walk(sub, ins, scope)
                    outs = [a | b for a, b in zip(outs, res)]
                for v, d in zip(eqn.outvars, outs):
                    env[v] = d | {nid}
            else:
                for v in eqn.outvars:
                    env[v] = every | {nid}
        return [deps_of(v, env) for v in jaxpr.outvars]

    walk(closed_jaxpr.jaxpr, [frozenset()] * len(closed_jaxpr.jaxpr.invars), "")
    return Analysis(nodes, ancestors)


def _is_literal(atom) -> bool:
    return type(atom).__name__ == "Literal"
