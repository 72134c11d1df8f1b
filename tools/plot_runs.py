"""Plot training and held-out loss of one or more runs against steps and tokens.

    python -m tools.plot_runs runs/ddp runs/diloco runs/streaming --out compare.png

Without --out, one run's plot goes to RUN/loss.png and several runs' to compare.png in their
common parent directory.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from diloco_eqx.training.plots import default_out, plot_runs


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help="run directories (with metrics.jsonl)")
    parser.add_argument("--out", default=None,
                        help="PNG to write (default: RUN/loss.png, or compare.png beside several runs)")
    parser.add_argument("--smooth", type=int, default=10, help="moving-average window (steps)")
    return parser


def main(argv=None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    run_dirs = [Path(r) for r in args.runs]
    try:
        print(plot_runs(run_dirs, args.out or default_out(run_dirs), args.smooth))
    except ValueError as e:
        parser.error(str(e))


if __name__ == "__main__":
    main()
