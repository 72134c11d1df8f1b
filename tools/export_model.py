"""Export a run's outer model as a plain Equinox file, loadable without anything DiLoCo.

    python -m tools.export_model runs/default --out exports/default

Writes OUT/model.eqx (`eqx.tree_serialise_leaves` of the outer model of the latest
checkpoint, or --step's), OUT/model.json (its factory and TransformerConfig, the run and
step it came from, and its held-out loss) and, for a BPE run, OUT/tokenizer.json. Load it with

    from diloco_eqx.models.io import load_model
    model, loss_fn, config = load_model("exports/default")
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", help="run directory (with run.json and checkpoints/)")
    parser.add_argument("--out", required=True, help="directory to write model.eqx and model.json to")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    out = Path(args.out)
    if (out / "model.eqx").exists():
        parser.error(f"--out {out} already holds an exported model; choose another --out")

    from diloco_eqx.training.loop import mean_loss
    from diloco_eqx.training.saved_runs import load_outer_model, model_config, recorded_eval_loss
    from diloco_eqx.models.io import save_model

    try:
        saved = load_outer_model(args.run, args.step)
    except ValueError as e:
        parser.error(str(e))
    import equinox as eqx

    loss = mean_loss(eqx.filter_jit(saved.job.loss_fn), saved.model, saved.job.held_out)
    config = model_config(args.run)
    extra = {"run": str(Path(args.run).resolve()), "step": saved.step, "mode": saved.cfg.mode,
             "tokenizer": saved.cfg.data.tokenizer, "seq_len": saved.cfg.data.seq_len, "eval_loss": loss}
    save_model(out, saved.model, saved.cfg.model_factory, config, extra)
    if (Path(args.run) / "tokenizer.json").exists():
        shutil.copy(Path(args.run) / "tokenizer.json", out / "tokenizer.json")
    recorded = recorded_eval_loss(args.run, saved.step)
    print(f"exported the outer model of {args.run} at step {saved.step} to {out}: held-out loss "
          f"{loss:.4f}" + (f" (the run recorded {recorded:.4f} there)" if recorded is not None else ""),
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
