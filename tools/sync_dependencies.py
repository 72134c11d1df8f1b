"""Print the data-dependency evidence that a config's sync collective is (or is not) on the
critical path of the step that runs it.

    python -m tools.sync_dependencies --overlap-steps 1          # deferred exchange (default for V >= 1)
    python -m tools.sync_dependencies --overlap-steps 1 --direct # the direct form, for contrast
    python -m tools.sync_dependencies --no-streaming

The step is traced on a mesh of D simulated devices, where the deferred exchange is free to
run under the inner step; `--exchange-after-inner` traces it waiting for the inner step, as it
is built without a mesh.

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
                   help="the deferred exchange waiting for the inner step, as built without a mesh")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    d = use_host_devices(args)
    import numpy as np
    import optax

    import diloco_eqx as dl
    from diloco_eqx.analysis import critical_path
    from diloco_eqx.diloco import with_plan
    from diloco_eqx.models.transformer import loss_fn
    from tools.comm_report import _mesh, _model, config_from

    model = _model(args.layers, args.width, args.heads, args.seq_len)
    inner = optax.adamw(1e-3)
    try:
        cfg = config_from(args)
        mesh = _mesh(d, args.data_parallel, args.fsdp)
        algo = dl.DiLoCo(cfg, loss_fn, inner, mesh=mesh, backend=args.backend)
        if args.direct:
            algo = with_plan(algo, deferred=False, exchange_after_inner=False)
        elif args.exchange_after_inner:
            algo = with_plan(algo, exchange_after_inner=True)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    batch = np.zeros((args.global_batch or 2 * args.num_replicas, args.seq_len + 1), np.int32)
    a = critical_path.analyze(algo.jaxpr(algo.init(model), batch))
    form = "deferred exchange" if algo.plan.deferred else "direct form"
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
