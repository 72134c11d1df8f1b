"""Generate text from a run's outer model (or an exported model), to see what it learned.

    python -m tools.sample runs/default --prompt "def " --tokens 200
    python -m tools.sample exports/default --prompt "import " --temperature 0.8 --top-k 40

RUN is a run directory (the outer model of its latest checkpoint, or --step's) or a directory
written by tools/export_model.py. The prompt is encoded with the run's tokenizer (bytes, or
its BPE's tokenizer.json); the prompt and the generated text are printed to stdout.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", help="run directory, or an exported model's directory")
    parser.add_argument("--prompt", default="def ", help="text the model continues")
    parser.add_argument("--tokens", type=int, default=200, help="tokens to generate")
    parser.add_argument("--temperature", type=float, default=0.8,
                        help="softmax temperature (0: always the most likely token)")
    parser.add_argument("--top-k", type=int, default=40, help="draw among the k most likely tokens (0: all)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the draws")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step of a run (default: the latest)")
    return parser


def load(run: Path, step: int | None):
    """(model, tokenizer, context length) of a run directory or an export."""
    from diloco_eqx.training import tokenizer as tok

    if (run / "model.json").is_file():  # an export
        from diloco_eqx.models.io import load_model

        model, _, config = load_model(run)
        tokens = tok.load(run / "tokenizer.json") if (run / "tokenizer.json").is_file() else tok.from_spec("bytes")
        context = json.loads((run / "model.json").read_text()).get("seq_len", getattr(config, "seq_len", None))
        return model, tokens, context
    from diloco_eqx.training.saved_runs import load_outer_model

    saved = load_outer_model(run, step)
    return saved.model, tok.for_run(run), saved.cfg.data.seq_len


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    for name in ("tokens", "top_k"):
        if getattr(args, name) < 0:
            parser.error(f"--{name.replace('_', '-')} must be >= 0; got {getattr(args, name)}")
    if args.temperature < 0:
        parser.error(f"--temperature must be >= 0; got {args.temperature}")
    from diloco_eqx.models.sampling import sample

    try:
        model, tokenizer, context = load(Path(args.run), args.step)
        prompt = [int(t) for t in tokenizer.encode(args.prompt)]
        if not prompt:
            parser.error("--prompt must not be empty")
    except ValueError as e:
        parser.error(str(e))
    out = sample(model, prompt, args.tokens, context=context, temperature=args.temperature,
                 top_k=args.top_k, seed=args.seed)
    sys.stdout.write(args.prompt + tokenizer.decode(out) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
