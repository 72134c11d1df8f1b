"""Print the data-dependency evidence that a config's sync collective is (or is not) on the
critical path of the step that runs it.

    python -m tools.sync_dependencies --overlap-steps 1          # deferred exchange (default for V >= 1)
    python -m tools.sync_dependencies --overlap-steps 1 --direct # the direct form, for contrast
    python -m tools.sync_dependencies --no-streaming

The deferred exchange is traced as it is built for an accelerator, free to run under the inner
step; `--exchange-after-inner` traces it waiting for the inner step, as it is built by default
without a mesh and on XLA:CPU with islands of one device (`diloco_eqx.step.exchange_waits_by_default`).

For every cross-island collective in the traced step: its primitive, its scope, and how
many equations of the same step's inner step (forward, backward, AdamW) it depends on;
then whether any inner-step equation depends on a collective. See diloco_eqx/analysis/critical_path.py.
"""

from __future__ import annotations

import argparse
import sys

from tools.comm_report import build_parser as comm_parser
from tools.comm_report import use_host_devices


def build_parser() -> argparse.ArgumentParser:
    p = comm_parser()
    p.prog = "python -m tools.sync_dependencies"
    p.description = __doc__
    p.add_argument("--direct", action="store_true",
                   help="force the direct form (exchange inside the sync step) even for V >= 1")
    p.add_argument("--exchange-after-inner", action="store_true",
                   help="the deferred exchange waiting for the inner step, as built by default without a "
                        "mesh and on XLA:CPU with islands of one device")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    d = use_host_devices(args)
    import numpy as np
    import optax

    import diloco_eqx as dl
    from diloco_eqx.analysis import critical_path
    from diloco_eqx.models.transformer import loss_fn
    from tools.comm_report import _mesh, _model, config_from

    model = _model(args.layers, args.width, args.heads, args.seq_len)
    inner = optax.adamw(1e-3)
    try:
        cfg = config_from(args)
        mesh = _mesh(d, args.data_parallel, args.fsdp)
        step = dl.make_train_step(cfg, loss_fn, inner, mesh, deferred=False if args.direct else None,
                                  backend=args.backend, exchange_after_inner=args.exchange_after_inner)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    state = dl.init_state(model, inner, cfg, mesh)
    batch = np.zeros((args.global_batch or 2 * args.num_replicas, args.seq_len + 1), np.int32)
    a = critical_path.analyze(step.jaxpr(state, batch))
    form = "deferred exchange" if step.deferred else "direct form"
    inner_ids = a.in_scope(critical_path.INNER_SCOPE)
    print(f"{form}: {len(a.nodes)} equations, {len(inner_ids)} in the inner step, "
          f"{len(a.collectives())} cross-island collectives")
    deps = a.collective_depends_on_inner_step()
    for c in a.collectives():
        print(f"  {c.primitive:<22} {c.scope:<48} depends on {deps[c.id]:>5} inner-step equations")
    back = a.inner_step_depends_on_collective()
    print(f"inner-step equations that depend on a collective: {len(back)}")
    off = all(v == 0 for v in deps.values()) and not back
    print("=> the exchange is off the critical path: it can overlap the inner step"
          if off else "=> the exchange waits for the inner step (it is on the critical path)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
