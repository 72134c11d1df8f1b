"""Train a byte-level transformer with DDP, DiLoCo or Streaming DiLoCo.

    python -m experiments.train                      # the default Streaming DiLoCo job
    python -m experiments.train --mode ddp --out runs/ddp
    python -m experiments.train --no-streaming --sync-period 30 --out runs/diloco
    python -m experiments.train --out runs/x --resume  # continue from the latest checkpoint

The same command is installed as `diloco-train`; `--help` lists every flag. The flags come
from the config dataclasses (diloco_eqx.DiLoCoConfig, diloco_eqx.models.transformer.TransformerConfig,
diloco_eqx.training.config); the run itself is diloco_eqx.training.runner.
"""

from __future__ import annotations

import sys

from diloco_eqx.training import cli
from diloco_eqx.training.config import RunConfig
from diloco_eqx.training.runner import run

PROG = "python -m experiments.train"

__all__ = ["PROG", "RunConfig", "main", "parse_settings", "run"]


def parse_settings(argv: list[str] | None = None) -> RunConfig:
    return cli.parse_settings(argv, PROG)


def main(argv: list[str] | None = None) -> int:
    return cli.main(argv, PROG)


if __name__ == "__main__":
    sys.exit(main())
