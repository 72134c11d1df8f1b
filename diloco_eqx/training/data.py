"""Data: corpora of byte-tokenized documents -> fixed windows -> global batches (grain).

A `Corpus` is a list of documents (files) concatenated into one uint8 token array. The
held-out split is by document, chosen by a hash of the document's name, so it never
changes with the seed and no window straddles the split. Training windows are
non-overlapping `seq_len + 1`-token slices inside one document; a grain `MapDataset`
shuffles them per epoch (seeded) and batches them into global batches of GBS rows, which
the train step splits into K island shards of GBS/K consecutive rows. With `non_iid=True`
each island draws only from its own contiguous block of documents.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import math
import os
import sys
import sysconfig
import warnings
from collections.abc import Sequence
from pathlib import Path

import grain
import numpy as np
from jaxtyping import Int, UInt8

VOCAB_SIZE = 256


def encode(text: str | bytes) -> UInt8[np.ndarray, " n"]:
    """Byte-level tokenizer: UTF-8 bytes are the tokens (vocabulary 256)."""
    data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
    return np.frombuffer(data, np.uint8).copy()


def decode(tokens) -> str:
    return bytes(np.asarray(tokens, np.uint8)).decode("utf-8", errors="replace")


@dataclasses.dataclass(frozen=True)
class Corpus:
    """Documents as one token array: document i is tokens[offsets[i]:offsets[i+1]]."""

    name: str
    tokens: UInt8[np.ndarray, " n"]
    offsets: Int[np.ndarray, " d1"]
    doc_names: tuple[str, ...]
    entropy_rate: float | None = None
    """Nats per token of the source, where known (synthetic corpora): the optimum loss."""
    metadata: dict = dataclasses.field(default_factory=dict)

    @classmethod
    def from_documents(cls, name: str, docs: Sequence[tuple[str, bytes]], **kw) -> Corpus:
        if not docs:
            raise ValueError(f"corpus {name!r} is empty: no documents found")
        sizes = np.array([len(d) for _, d in docs], np.int64)
        if sizes.sum() == 0:
            raise ValueError(f"corpus {name!r} is empty: its {len(docs)} documents hold no bytes")
        tokens = np.frombuffer(b"".join(d for _, d in docs), np.uint8)
        offsets = np.concatenate([[0], np.cumsum(sizes)])
        meta = {"corpus": name, "documents": len(docs), "bytes": int(sizes.sum())}
        meta.update(kw.pop("metadata", {}))
        return cls(name, tokens, offsets, tuple(n for n, _ in docs), metadata=meta, **kw)

    @classmethod
    def stdlib(cls) -> Corpus:
        """The running Python's standard library `.py` sources, in sorted path order."""
        root = Path(sysconfig.get_paths()["stdlib"])
        files = sorted(
            p for p in root.rglob("*.py") if "site-packages" not in p.parts and p.is_file()
        )
        docs = [(str(p.relative_to(root)), p.read_bytes()) for p in files]
        version = ".".join(map(str, sys.version_info[:3]))
        return cls.from_documents(
            f"python{version}-stdlib", docs, metadata={"python_version": version, "root": str(root)}
        )

    @classmethod
    def from_files(cls, patterns: Sequence[str]) -> Corpus:
        """Text files named by paths, directories (every file under them) or globs.

        Files that look binary (a NUL byte in their first 8 KiB) are skipped with a warning
        that counts them: byte-level language modelling of executables is rarely meant."""
        paths: list[Path] = []
        for pattern in patterns:
            matches = sorted(glob.glob(os.path.expanduser(pattern), recursive=True))
            if not matches:
                raise ValueError(f"corpus path {pattern!r} matches no file or directory")
            for m in map(Path, matches):
                paths.extend(sorted(p for p in m.rglob("*") if p.is_file()) if m.is_dir() else [m])
        docs, skipped, skipped_bytes = [], 0, 0
        for p in sorted(set(paths)):
            if looks_binary(p):
                skipped, skipped_bytes = skipped + 1, skipped_bytes + p.stat().st_size
            else:
                docs.append((str(p), p.read_bytes()))
        name = "files:" + ",".join(patterns)
        if skipped and not docs:
            raise ValueError(f"corpus {name!r} holds only binary files ({skipped}, a NUL byte in "
                             f"the first {BINARY_PROBE} bytes of each); give text files")
        if skipped:
            warnings.warn(
                f"corpus {name!r}: skipped {skipped} binary file(s) ({skipped_bytes:,} bytes; a "
                f"NUL byte in the first {BINARY_PROBE} bytes); kept {len(docs)} text file(s)",
                stacklevel=2,
            )
        return cls.from_documents(name, docs, metadata={"skipped_binary_files": skipped})

    @classmethod
    def markov(
        cls, num_bytes: int = 4_000_000, branching: int = 2, seed: int = 0, doc_bytes: int = 65_536
    ) -> Corpus:
        """A random sparse Markov chain over bytes: each byte has `branching` equally likely
        successors, so every next-token prediction has entropy exactly ln(branching)."""
        if not 1 <= branching <= VOCAB_SIZE:
            raise ValueError(f"branching must be in 1..{VOCAB_SIZE}; got {branching}")
        rng = np.random.default_rng(seed)
        successors = np.stack(
            [rng.choice(VOCAB_SIZE, branching, replace=False) for _ in range(VOCAB_SIZE)]
        )
        n_docs = max(2, math.ceil(num_bytes / doc_bytes))
        choice = rng.integers(0, branching, (n_docs, doc_bytes))
        seq = np.empty((n_docs, doc_bytes), np.uint8)
        seq[:, 0] = rng.integers(0, VOCAB_SIZE, n_docs)
        for t in range(1, doc_bytes):
            seq[:, t] = successors[seq[:, t - 1], choice[:, t]]
        docs = [(f"markov/{i:05d}", seq[i].tobytes()) for i in range(n_docs)]
        return cls.from_documents(
            f"markov(b={branching},seed={seed})",
            docs,
            entropy_rate=math.log(branching),
            metadata={"branching": branching, "seed": seed},
        )

    @property
    def num_docs(self) -> int:
        return len(self.doc_names)

    def doc_sizes(self) -> Int[np.ndarray, " d"]:
        return np.diff(self.offsets)

    def split(self, eval_fraction: float = 0.02) -> tuple[np.ndarray, np.ndarray]:
        """(train, held-out) document ids; a document is held out when the MD5 of its name
        falls in the lowest `eval_fraction` of hash space. Both sides are non-empty."""
        if not 0.0 < eval_fraction < 1.0:
            raise ValueError(f"eval_fraction must be in (0, 1); got {eval_fraction}")
        if self.num_docs < 2:
            raise ValueError(
                f"corpus {self.name!r} has {self.num_docs} document; the held-out split is by "
                "document, so give at least 2 files"
            )
        h = np.array(
            [int(hashlib.md5(n.encode()).hexdigest()[:12], 16) / 16**12 for n in self.doc_names]
        )
        held = h < eval_fraction
        if not held.any():
            held[np.argmin(h)] = True
        if held.all():
            held[np.argmax(h)] = False
        return np.flatnonzero(~held), np.flatnonzero(held)

    def windows(self, doc_ids: Sequence[int], length: int) -> Int[np.ndarray, " w"]:
        """Start offsets of the non-overlapping `length`-token windows inside `doc_ids`."""
        starts = [
            np.arange(self.offsets[d], self.offsets[d + 1] - length + 1, length, dtype=np.int64)
            for d in doc_ids
        ]
        return np.concatenate(starts) if starts else np.zeros((0,), np.int64)

    def unigram_entropy(self, doc_ids: Sequence[int] | None = None) -> float:
        """Entropy (nats) of the byte distribution: the loss of the best context-free model."""
        ids = range(self.num_docs) if doc_ids is None else doc_ids
        counts = np.zeros(VOCAB_SIZE, np.int64)
        for d in ids:
            counts += np.bincount(self.tokens[self.offsets[d] : self.offsets[d + 1]], minlength=VOCAB_SIZE)
        p = counts[counts > 0] / counts.sum()
        return float(-(p * np.log(p)).sum())


BINARY_PROBE = 8192


def looks_binary(path: Path) -> bool:
    """True if the file's first 8 KiB hold a NUL byte (text files, UTF-8 or not, do not)."""
    with open(path, "rb") as f:
        return b"\0" in f.read(BINARY_PROBE)


class Windows(grain.sources.RandomAccessDataSource):
    """Random access to fixed-length windows of a corpus, as int32 token rows."""

    def __init__(self, tokens: np.ndarray, starts: np.ndarray, length: int):
        self.tokens, self.starts, self.length = tokens, starts, length

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> Int[np.ndarray, " length"]:
        s = self.starts[i]
        return self.tokens[s : s + self.length].astype(np.int32)


def _batches(tokens, starts, length, rows, seed, keep) -> grain.MapDataset:
    """Batches of `rows` shuffled windows, of which rows keep[0]..keep[1]-1 are read."""
    windows = Windows(tokens, starts, length)
    order = grain.MapDataset.range(len(windows)).shuffle(seed=seed)
    batches = order.batch(rows, drop_remainder=True).repeat()
    return batches.map(lambda idx: np.stack([windows[i] for i in idx[keep[0] : keep[1]]]))


def island_documents(corpus: Corpus, doc_ids: np.ndarray, num_islands: int) -> list[np.ndarray]:
    """Split documents into `num_islands` contiguous blocks of about equal bytes."""
    sizes = corpus.doc_sizes()[doc_ids]
    targets = np.arange(1, num_islands) * sizes.sum() / num_islands
    edges = np.searchsorted(np.cumsum(sizes), targets, side="right")
    return np.split(doc_ids, edges)


def train_batches(
    corpus: Corpus,
    doc_ids: np.ndarray,
    *,
    seq_len: int,
    global_batch: int,
    num_islands: int,
    seed: int,
    non_iid: bool = False,
    rows: tuple[int, int] | None = None,
) -> grain.MapDataset:
    """Endless global batches int32[GBS, seq_len + 1]; rows [k·GBS/K, (k+1)·GBS/K) are island k's.

    Windows are drawn without replacement within an epoch (so a global batch never holds one
    window twice) and reshuffled every epoch from `seed`. With `rows=(lo, hi)` each batch
    holds only rows lo..hi-1 of the global batch and only those windows are read (a process
    loads just its own islands' data); the order is the same as the full batch's.
    """
    length = seq_len + 1
    if global_batch % num_islands:
        raise ValueError(
            f"global batch size (GBS)={global_batch} must be divisible by num_replicas "
            f"(K)={num_islands}"
        )
    lo, hi = (0, global_batch) if rows is None else rows
    if not 0 <= lo < hi <= global_batch:
        raise ValueError(f"rows must be a range inside 0..{global_batch}; got {rows}")
    groups = island_documents(corpus, doc_ids, num_islands) if non_iid else [doc_ids]
    per = global_batch // len(groups)
    per_group = []
    for k, ids in enumerate(groups):
        mine = (max(lo - k * per, 0), min(hi - k * per, per))  # this group's rows we keep
        if mine[0] >= mine[1]:
            continue
        starts = corpus.windows(ids, length)
        if len(starts) < per:
            where = f"island {k}'s documents" if non_iid else "the training documents"
            longest = int(corpus.doc_sizes()[ids].max()) if len(ids) else 0
            raise ValueError(
                f"seq_len={seq_len} leaves {len(starts)} windows of {length} tokens in {where} "
                f"(longest document: {longest} bytes), fewer than the {per} rows a batch needs; "
                "use a shorter --seq-len, a smaller --global-batch or a larger corpus"
            )
        per_group.append(_batches(corpus.tokens, starts, length, per, seed + 1000 * k, mine))
    if len(per_group) == 1:
        return per_group[0]
    return grain.MapDataset.range(sys.maxsize).map(
        lambda i: np.concatenate([g[i] for g in per_group])
    )


def eval_batches(
    corpus: Corpus, doc_ids: np.ndarray, *, seq_len: int, batch_size: int, max_batches: int
) -> list[Int[np.ndarray, "B L1"]]:
    """A fixed held-out set: windows spread evenly over the held-out documents."""
    starts = corpus.windows(doc_ids, seq_len + 1)
    if len(starts) == 0:
        raise ValueError(
            f"seq_len={seq_len}: no held-out document is longer than {seq_len + 1} bytes; "
            "use a shorter --seq-len"
        )
    n = min(len(starts), batch_size * max_batches)
    n = max(batch_size, n - n % batch_size) if n >= batch_size else n
    pick = starts[np.linspace(0, len(starts) - 1, n).astype(np.int64)]
    source = Windows(corpus.tokens, pick, seq_len + 1)
    rows = np.stack([source[i] for i in range(len(source))])
    return [rows[i : i + batch_size] for i in range(0, len(rows), batch_size)]
