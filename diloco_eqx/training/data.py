"""Data: a tokenized corpus -> fixed windows -> global batches (grain).

A `Corpus` is a token file (token_files.py) opened read-only: a text source (sources.py)
tokenized into the cache by `Corpus.from_source`, or a pre-tokenized file opened by
`Corpus.from_token_file`. Windows are read from the file with pread (`TokenReader`), so the
process's memory stays flat however large the file (reading through a memory map instead
maps whole folios of the page cache into the process, megabytes at a time).

Training windows are non-overlapping `seq_len + 1`-token slices inside one document; a grain
`MapDataset` shuffles them per epoch (seeded) and batches them into global batches of GBS
rows, which the train step splits into K island shards of GBS/K consecutive rows; with
`non_iid=True` each island draws only from its own contiguous block of documents. The
held-out split is by document name (`sources.split_names`), so no window straddles it.
"""

from __future__ import annotations

import dataclasses
import mmap
import os
import sys
import weakref
from collections.abc import Sequence

import grain
import numpy as np
from jaxtyping import Int

from diloco_eqx.training.sources import (Documents, file_documents, markov_documents, split_names,
                                         stdlib_documents)
from diloco_eqx.training.token_files import TokenFile, cached_token_file, read_token_file, token_file_tokenizer
from diloco_eqx.training.tokenizer import BYTES, Tokenizer




# ------------------------------------------------------------------------------------ corpora


@dataclasses.dataclass(frozen=True)
class Corpus:
    """Documents as one token array (a read-only memmap when read from disk): document i is
    tokens[offsets[i]:offsets[i+1]], in the ids of `tokenizer`."""

    name: str
    tokens: Int[np.ndarray, " n"]
    offsets: Int[np.ndarray, " d1"]
    doc_names: tuple[str, ...]
    entropy_rate: float | None = None
    """Nats per token of the source, where known (synthetic corpora): the optimum loss."""
    metadata: dict = dataclasses.field(default_factory=dict)
    tokenizer: Tokenizer = BYTES

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    @classmethod
    def from_documents(cls, name: str, docs: Sequence[tuple[str, bytes]], tokenizer: Tokenizer = BYTES,
                       **kw) -> Corpus:
        """A small corpus tokenized in memory from (name, bytes) pairs."""
        if not docs:
            raise ValueError(f"corpus {name!r} is empty: no documents found")
        size = sum(len(d) for _, d in docs)
        if size == 0:
            raise ValueError(f"corpus {name!r} is empty: its {len(docs)} documents hold no bytes")
        ids = tokenizer.encode_many([d for _, d in docs])
        tokens = np.concatenate(ids).astype(tokenizer.dtype)
        offsets = np.concatenate([[0], np.cumsum([len(t) for t in ids])]).astype(np.int64)
        meta = {"corpus": name, "documents": len(docs), "bytes": size, "tokens": len(tokens),
                "tokenizer": tokenizer.spec} | kw.pop("metadata", {})
        return cls(name, tokens, offsets, tuple(n for n, _ in docs), metadata=meta, tokenizer=tokenizer, **kw)

    @classmethod
    def from_token_file(cls, tf: TokenFile | str | os.PathLike, tokenizer: Tokenizer | None = None) -> Corpus:
        """A memory-mapped corpus over a token file (with the file's own tokenizer by default)."""
        tf = tf if isinstance(tf, TokenFile) else read_token_file(tf)
        tokenizer = tokenizer or token_file_tokenizer(tf)
        src = tf.source
        meta = {"corpus": src["name"], "documents": len(tf.names), "tokens": tf.tokens,
                "tokenizer": tokenizer.spec, "token_file": str(tf.path)}
        if tf.text_bytes is not None:
            meta["bytes"] = tf.text_bytes
        meta |= src.get("metadata") or {}
        return cls(src["name"], tf.memmap(), tf.offsets, tf.names, src.get("entropy_rate"), meta, tokenizer)

    @classmethod
    def from_source(cls, docs: Documents, tokenizer: Tokenizer = BYTES) -> Corpus:
        """`docs` tokenized into the cache (once) and memory-mapped from there."""
        if not docs.names:
            raise ValueError(f"--corpus {docs.name!r} is empty: no documents found")
        return cls.from_token_file(cached_token_file(docs, tokenizer), tokenizer)

    @classmethod
    def stdlib(cls, tokenizer: Tokenizer = BYTES) -> Corpus:
        """The running Python's standard library `.py` sources, in sorted path order."""
        return cls.from_source(stdlib_documents(), tokenizer)

    @classmethod
    def from_files(cls, patterns: Sequence[str], tokenizer: Tokenizer = BYTES) -> Corpus:
        """Text files named by paths, directories or globs (binary files skipped, counted)."""
        return cls.from_source(file_documents(patterns), tokenizer)

    @classmethod
    def markov(cls, num_bytes: int = 4_000_000, branching: int = 2, seed: int = 0,
               doc_bytes: int = 65_536) -> Corpus:
        """A random sparse Markov chain over bytes whose optimum loss is ln(branching)."""
        return cls.from_source(markov_documents(num_bytes, branching, seed, doc_bytes))

    @property
    def num_docs(self) -> int:
        return len(self.doc_names)

    def doc_sizes(self) -> Int[np.ndarray, " d"]:
        return np.diff(self.offsets)

    def split(self, eval_fraction: float = 0.02) -> tuple[np.ndarray, np.ndarray]:
        """(train, held-out) document ids, by the MD5 of their names (`split_names`)."""
        try:
            return split_names(self.doc_names, eval_fraction)
        except ValueError as e:
            raise ValueError(f"corpus {self.name!r}: {e}") from None

    def windows(self, doc_ids: Sequence[int], length: int) -> Int[np.ndarray, " w"]:
        """Start offsets of the non-overlapping `length`-token windows inside `doc_ids`."""
        starts = [
            np.arange(self.offsets[d], self.offsets[d + 1] - length + 1, length, dtype=np.int64)
            for d in doc_ids
        ]
        return np.concatenate(starts) if starts else np.zeros((0,), np.int64)

    def unigram_entropy(self, doc_ids: Sequence[int] | None = None, chunk: int = 1 << 20) -> float:
        """Entropy (nats) of the token distribution: the loss of the best context-free model.
        Reads the documents a chunk at a time."""
        ids = range(self.num_docs) if doc_ids is None else doc_ids
        counts, read = np.zeros(self.vocab_size, np.int64), TokenReader(self.tokens)
        for d in ids:
            for s in range(int(self.offsets[d]), int(self.offsets[d + 1]), chunk):
                part = read(s, min(s + chunk, int(self.offsets[d + 1])))
                counts += np.bincount(part, minlength=self.vocab_size)[: self.vocab_size]
        p = counts[counts > 0] / counts.sum()
        return float(-(p * np.log(p)).sum())


# ------------------------------------------------------------------------------------ batches


def _file_position(tokens: np.ndarray) -> tuple[str, int] | None:
    """(file, byte offset of tokens[0]) of a contiguous memmap; None for an in-memory array."""
    if not isinstance(tokens, np.memmap) or getattr(tokens, "_mmap", None) is None:
        return None
    if tokens.ndim != 1 or not tokens.flags.c_contiguous:
        return None
    mapped_from = tokens.offset - tokens.offset % mmap.ALLOCATIONGRANULARITY  # as np.memmap maps
    return tokens.filename, mapped_from + tokens.ctypes.data - np.frombuffer(tokens._mmap, np.uint8).ctypes.data


class TokenReader:
    """Reads tokens[start:stop]. A memmap's ids are read from its file with pread, so that no
    page of it stays mapped: where the page cache holds large folios, one fault on a memmap
    maps megabytes, and random windows soon map the whole file into the process's RSS. An
    in-memory array is sliced."""

    def __init__(self, tokens: np.ndarray):
        self.tokens, self._file, self._fd = tokens, _file_position(tokens), None
        if self._file:
            self._fd = os.open(self._file[0], os.O_RDONLY)
            weakref.finalize(self, os.close, self._fd)

    def __call__(self, start: int, stop: int) -> Int[np.ndarray, " n"]:
        if self._fd is None:
            return np.asarray(self.tokens[start:stop])
        item = self.tokens.dtype.itemsize
        return np.frombuffer(os.pread(self._fd, (stop - start) * item, self._file[1] + start * item),
                             self.tokens.dtype)

    def __getstate__(self) -> dict:
        return {"tokens": self.tokens}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["tokens"])


class Windows(grain.sources.RandomAccessDataSource):
    """Random access to fixed-length windows of a corpus, as int32 token rows (only the
    window's ids are read)."""

    def __init__(self, tokens: np.ndarray, starts: np.ndarray, length: int):
        self.tokens, self.starts, self.length = tokens, starts, length
        self._read = TokenReader(tokens)

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> Int[np.ndarray, " length"]:
        s = int(self.starts[i])
        return self._read(s, s + self.length).astype(np.int32)


def _batches(tokens, starts, length, rows, seed, keep) -> grain.MapDataset:
    """Batches of `rows` shuffled windows, of which rows keep[0]..keep[1]-1 are read."""
    windows = Windows(tokens, starts, length)
    order = grain.MapDataset.range(len(windows)).shuffle(seed=seed)
    batches = order.batch(rows, drop_remainder=True).repeat()
    return batches.map(lambda idx: np.stack([windows[i] for i in idx[keep[0] : keep[1]]]))


def island_documents(corpus: Corpus, doc_ids: np.ndarray, num_islands: int) -> list[np.ndarray]:
    """Split documents into `num_islands` contiguous blocks of about equal tokens."""
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
                f"(longest document: {longest} tokens), fewer than the {per} rows a batch needs; "
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
            f"seq_len={seq_len}: no held-out document is longer than {seq_len + 1} tokens; "
            "use a shorter --seq-len"
        )
    n = min(len(starts), batch_size * max_batches)
    n = max(batch_size, n - n % batch_size) if n >= batch_size else n
    pick = starts[np.linspace(0, len(starts) - 1, n).astype(np.int64)]
    source = Windows(corpus.tokens, pick, seq_len + 1)
    rows = np.stack([source[i] for i in range(len(source))])
    return [rows[i : i + batch_size] for i in range(0, len(rows), batch_size)]
