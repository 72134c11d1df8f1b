"""Text sources: a corpus's documents, named and read one at a time.

`Documents` is what `--corpus` names before tokenization: the running Python's stdlib
sources, files / directories / globs, a synthetic Markov chain over bytes, or the records of
ArrayRecord files (one document's UTF-8 text each). Each source has a fingerprint (paths,
sizes, mtimes, or its generator's parameters) that keys its cached token file. The held-out
split (`split_names`) is by document, by the MD5 of the name, so it never changes with the
seed or the tokenizer.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import glob
import hashlib
import math
import os
import sys
import sysconfig
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import grain
import numpy as np




VOCAB_SIZE = 256
BINARY_PROBE = 8192

# ------------------------------------------------------------------------------ text sources


@dataclasses.dataclass(frozen=True)
class Documents:
    """A text source: its documents' names, and `read(i)`, document i's bytes, so that it is
    tokenized one document at a time. `fingerprint` (JSON) identifies its content for the
    cache: paths, sizes and mtimes of files, or a generator's parameters."""

    name: str
    names: tuple[str, ...]
    read: Callable[[int], bytes]
    fingerprint: Any
    metadata: dict = dataclasses.field(default_factory=dict)
    entropy_rate: float | None = None

    def texts(self, doc_ids: Sequence[int]):
        """The documents `doc_ids`, read one by one."""
        return (self.read(int(i)) for i in doc_ids)


def _file_documents(name: str, paths: Sequence[Path], names: Sequence[str], **kw) -> Documents:
    stats = [p.stat() for p in paths]
    return Documents(name, tuple(names), lambda i: paths[i].read_bytes(),
                     [[str(p.resolve()), s.st_size, s.st_mtime_ns] for p, s in zip(paths, stats)], **kw)


def stdlib_documents() -> Documents:
    """The running Python's standard library `.py` sources, in sorted path order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and p.is_file())
    version = ".".join(map(str, sys.version_info[:3]))
    return _file_documents(f"python{version}-stdlib", files, [str(p.relative_to(root)) for p in files],
                           metadata={"python_version": version, "root": str(root)})


def _expand(patterns: Sequence[str]) -> list[Path]:
    """Every file named by paths, directories (every file under them) or globs."""
    paths: list[Path] = []
    for pattern in patterns:
        matches = sorted(glob.glob(os.path.expanduser(pattern), recursive=True))
        if not matches:
            raise ValueError(f"--corpus path {pattern!r} matches no file or directory")
        for m in map(Path, matches):
            paths.extend(sorted(p for p in m.rglob("*") if p.is_file()) if m.is_dir() else [m])
    return sorted(set(paths))


def file_documents(patterns: Sequence[str]) -> Documents:
    """Text files named by paths, directories or globs, each one document.

    Files that look binary (a NUL byte in their first 8 KiB) are skipped with a warning
    that counts them: language modelling of executables is rarely meant."""
    paths = _expand(patterns)
    binary = {p for p in paths if looks_binary(p)}
    texts = [p for p in paths if p not in binary]
    name = "files:" + ",".join(patterns)
    if binary and not texts:
        raise ValueError(f"--corpus {name!r} holds only binary files ({len(binary)}, a NUL byte "
                         f"in the first {BINARY_PROBE} bytes of each); give text files")
    if binary:
        warnings.warn(
            f"corpus {name!r}: skipped {len(binary)} binary file(s) "
            f"({sum(p.stat().st_size for p in binary):,} bytes; a NUL byte in the first "
            f"{BINARY_PROBE} bytes); kept {len(texts)} text file(s)", stacklevel=2)
    return _file_documents(name, texts, [str(p) for p in texts],
                           metadata={"skipped_binary_files": len(binary)})


def markov_documents(num_bytes: int = 4_000_000, branching: int = 2, seed: int = 0,
                     doc_bytes: int = 65_536) -> Documents:
    """A random sparse Markov chain over bytes: each byte has `branching` equally likely
    successors, so every next-byte prediction has entropy exactly ln(branching)."""
    if not 1 <= branching <= VOCAB_SIZE:
        raise ValueError(f"--corpus markov: branching must be in 1..{VOCAB_SIZE}; got {branching}")
    n_docs = max(2, math.ceil(num_bytes / doc_bytes))

    @functools.cache
    def chain() -> np.ndarray:
        rng = np.random.default_rng(seed)
        successors = np.stack([rng.choice(VOCAB_SIZE, branching, replace=False) for _ in range(VOCAB_SIZE)])
        choice = rng.integers(0, branching, (n_docs, doc_bytes))
        seq = np.empty((n_docs, doc_bytes), np.uint8)
        seq[:, 0] = rng.integers(0, VOCAB_SIZE, n_docs)
        for t in range(1, doc_bytes):
            seq[:, t] = successors[seq[:, t - 1], choice[:, t]]
        return seq

    params = {"num_bytes": num_bytes, "branching": branching, "seed": seed, "doc_bytes": doc_bytes}
    return Documents(f"markov(b={branching},seed={seed})", tuple(f"markov/{i:05d}" for i in range(n_docs)),
                     lambda i: chain()[i].tobytes(), {"markov": params},
                     metadata={"branching": branching, "seed": seed}, entropy_rate=math.log(branching))


def array_record_documents(patterns: Sequence[str]) -> Documents:
    """ArrayRecord files (paths or globs), each record one document's UTF-8 text, read through
    grain's `ArrayRecordDataSource`; record j of file F is named "F#j" (F its file name)."""
    paths = _expand(patterns)
    sources = []
    for p in paths:
        try:
            sources.append(grain.sources.ArrayRecordDataSource([str(p)]))
        except RuntimeError as e:
            raise ValueError(f"--corpus {p}: not a readable ArrayRecord file ({e})") from None
    ends = np.cumsum([len(s) for s in sources]).tolist()
    names = [f"{p.name}#{j}" for p, s in zip(paths, sources) for j in range(len(s))]

    def read(i: int) -> bytes:
        f = bisect.bisect_right(ends, i)
        return sources[f][i - (ends[f - 1] if f else 0)]

    stats = [p.stat() for p in paths]
    return Documents("array_record:" + ",".join(patterns), tuple(names), read,
                     [[str(p.resolve()), s.st_size, s.st_mtime_ns] for p, s in zip(paths, stats)])


def documents(spec: Sequence[str]) -> Documents:
    """The text source `--corpus` names: stdlib | markov [key=value ...] | ArrayRecord files
    (paths or globs ending in .array_record) | text files, directories or globs."""
    spec = tuple(spec)
    if spec == ("stdlib",):
        return stdlib_documents()
    if spec[0] == "markov":
        return markov_documents(**_markov_options(spec[1:]))
    records = [s.endswith(".array_record") for s in spec]
    if any(records) and not all(records):
        raise ValueError("--corpus: give ArrayRecord files or text files, not both")
    return array_record_documents(spec) if all(records) else file_documents(spec)


def _markov_options(args: Sequence[str]) -> dict[str, int]:
    names = ("num_bytes", "branching", "seed", "doc_bytes")
    pairs = [a.split("=", 1) for a in args]
    if any(len(p) != 2 or p[0] not in names or not p[1].isdigit() for p in pairs):
        raise ValueError(f"--corpus markov takes integer key=value options {', '.join(names)}; got "
                         f"{' '.join(args)}")
    return {k: int(v) for k, v in pairs}


def token_file(spec: Sequence[str]) -> Path | None:
    """The pre-tokenized file `--corpus` names (one path or glob ending in .bin), else None."""
    if not any(s.endswith(".bin") for s in spec):
        return None
    paths = _expand(spec)
    if len(spec) > 1 or len(paths) != 1 or paths[0].suffix != ".bin":
        raise ValueError(f"--corpus {' '.join(spec)}: give exactly one token file (.bin), or text "
                         "files; a token file does not mix with other sources")
    return paths[0]


def looks_binary(path: Path) -> bool:
    """True if the file's first 8 KiB hold a NUL byte (text files, UTF-8 or not, do not)."""
    with open(path, "rb") as f:
        return b"\0" in f.read(BINARY_PROBE)


def split_names(names: Sequence[str], eval_fraction: float = 0.02) -> tuple[np.ndarray, np.ndarray]:
    """(train, held-out) document ids; a document is held out when the MD5 of its name falls
    in the lowest `eval_fraction` of hash space. Both sides are non-empty."""
    if not 0.0 < eval_fraction < 1.0:
        raise ValueError(f"eval_fraction must be in (0, 1); got {eval_fraction}")
    if len(names) < 2:
        raise ValueError(f"the corpus has {len(names)} document; the held-out split is by "
                         "document, so give at least 2 files (--corpus)")
    h = np.array([int(hashlib.md5(n.encode()).hexdigest()[:12], 16) / 16**12 for n in names])
    held = h < eval_fraction
    if not held.any():
        held[np.argmin(h)] = True
    if held.all():
        held[np.argmax(h)] = False
    return np.flatnonzero(~held), np.flatnonzero(held)


