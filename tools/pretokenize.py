"""Tokenize text into a token file that `--corpus FILE.bin` trains on without re-tokenizing.

    python -m tools.pretokenize docs/ --tokenizer bpe:4096 --out data/docs.bin
    python -m tools.pretokenize stdlib --tokenizer runs/x/tokenizer.json --out data/stdlib.bin --llmc-header

The inputs are what --corpus takes for text: files, directories and globs, `stdlib`, `markov
[key=value ...]`, or .array_record files. --tokenizer is bytes, bpe:N (a byte-level BPE trained
on the inputs' training split: the documents a run holds out never shape it) or a
tokenizer.json, such as a run's. Writes OUT (flat ids; with --llmc-header after llm.c's 256 ×
int32 header), its sidecar OUT.json (document offsets and names, dtype, the tokenizer's
identity) and, for a BPE, the tokenizer beside them as OUT.tokenizer.json.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from diloco_eqx.training import sources, token_files
from diloco_eqx.training import tokenizer as tok_lib


def pretokenize(inputs: list[str], spec: str, out: Path, llmc_header: bool = False) -> token_files.TokenFile:
    """Write the token file `out` (and its sidecar, and its tokenizer if not bytes)."""
    if not out.name.endswith(".bin"):
        raise ValueError(f"--out {out}: a token file's name ends in .bin")
    docs = sources.documents(inputs)
    train_ids = sources.split_names(docs.names)[0]
    tok = tok_lib.from_spec(spec, lambda: docs.texts(train_ids))
    out.parent.mkdir(parents=True, exist_ok=True)
    tok_file = None
    if tok.kind != "bytes":
        tok_file = f"{out.name}.tokenizer.json"
        tok.save(out.with_name(tok_file))
    return token_files.write_token_file(out, docs, tok, llmc_header=llmc_header, tokenizer_file=tok_file)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("inputs", nargs="+", help="text files, directories, globs, stdlib, markov "
                        "[key=value ...] or .array_record files (as --corpus takes them)")
    parser.add_argument("--tokenizer", default="bytes", help=f"{tok_lib.SPEC_FORMS}")
    parser.add_argument("--out", required=True, type=Path, help="the token file to write (NAME.bin)")
    parser.add_argument("--llmc-header", action="store_true",
                        help=f"start the file with llm.c's header (magic {token_files.LLMC_MAGIC}; ids "
                             "then uint16 or uint32)")
    return parser


def main(argv=None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    try:
        tok_lib.parse_spec(args.tokenizer)
        tf = pretokenize(args.inputs, args.tokenizer, args.out, args.llmc_header)
    except ValueError as e:
        parser.error(str(e))
    per_byte = tf.tokens / tf.text_bytes
    print(f"wrote {args.out}: {len(tf.names):,} documents, {tf.text_bytes:,} bytes -> {tf.tokens:,} "
          f"{tf.dtype.name} ids ({per_byte:.4f} tokens/byte, vocabulary {tf.vocab_size}) in "
          f"{time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
