"""Token files: flat arrays of token ids on disk, read without loading them whole.

Ours are little-endian ids (uint8 for vocabularies up to 256, uint16 up to 65536, else
uint32), after an optional 1024-byte llm.c header, with a JSON sidecar `FILE.bin.json`
(dtype, document offsets and names, the tokenizer's identity). nanoGPT's raw uint16 streams
and llm.c's files (a 256 × int32 header: magic 20240520, version 1 = uint16, 2 = uint32)
read too, cut into pseudo-documents "FILE#INDEX" of 65,536 tokens. A text source is
tokenized once into a token file in the cache (`$DILOCO_EQX_CACHE`, default
~/.cache/diloco_eqx), keyed by the source's fingerprint and the tokenizer, written to a
temporary name and renamed (the sidecar last), so concurrent processes never see half a file.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import uuid
from pathlib import Path
from typing import Any

import numpy as np
from jaxtyping import Int

from diloco_eqx.training import tokenizer as tok_lib
from diloco_eqx.training.sources import Documents
from diloco_eqx.training.tokenizer import BYTES, Tokenizer



FORMAT = "diloco_eqx.tokens/1"
LLMC_MAGIC, LLMC_HEADER_BYTES = 20240520, 256 * 4
LLMC_VERSIONS = {1: np.dtype("<u2"), 2: np.dtype("<u4")}
RAW_DOC_TOKENS = 1 << 16
"""Tokens per pseudo-document of a token file without our sidecar (named "FILE#INDEX")."""

# ------------------------------------------------------------------------------- token files


@dataclasses.dataclass(frozen=True)
class TokenFile:
    """A token file's layout: `tokens` ids of `dtype` after `header_bytes`, documents at
    `offsets` named `names`, from `tokenizer` (its identity, and the tokenizer.json beside the
    file if any). `sidecar` is False for a file that came without ours (nanoGPT, llm.c)."""

    path: Path
    dtype: np.dtype
    header_bytes: int
    tokens: int
    offsets: Int[np.ndarray, " d1"]
    names: tuple[str, ...]
    vocab_size: int | None
    max_id: int | None
    tokenizer: dict | None
    source: dict
    text_bytes: int | None = None
    """Bytes of the text the ids came from (known from our sidecar)."""
    sidecar: bool = True

    def memmap(self) -> Int[np.ndarray, " n"]:
        """The ids, memory-mapped read-only: pages are read only when touched."""
        return np.memmap(self.path, self.dtype, "r", offset=self.header_bytes, shape=(self.tokens,))


def sidecar_path(path: Path) -> Path:
    """FILE.json beside the token file FILE."""
    return path.with_name(path.name + ".json")


def _llmc_header(path: Path) -> np.ndarray | None:
    with open(path, "rb") as f:
        head = f.read(LLMC_HEADER_BYTES)
    head = np.frombuffer(head, "<i4") if len(head) == LLMC_HEADER_BYTES else None
    return head if head is not None and head[0] == LLMC_MAGIC else None


def _layout(path: Path, side: dict | None) -> tuple[np.dtype, int, int]:
    """(dtype, header bytes, tokens) of a token file, from our sidecar, else an llm.c header,
    else raw uint16; ValueError naming --corpus if the file is corrupt."""
    size = path.stat().st_size
    head = _llmc_header(path) if side is None or side["header_bytes"] else None
    if head is not None:
        if int(head[1]) not in LLMC_VERSIONS:
            raise ValueError(f"--corpus {path}: corrupt llm.c header: version {head[1]} (1: uint16, "
                             "2: uint32)")
        dtype, header, count = LLMC_VERSIONS[int(head[1])], LLMC_HEADER_BYTES, int(head[2])
    else:
        dtype = np.dtype(side["dtype"]).newbyteorder("<") if side else np.dtype("<u2")
        header, count = 0, size // dtype.itemsize
    if size != header + count * dtype.itemsize or count == 0:
        raise ValueError(f"--corpus {path}: corrupt or empty token file: {size:,} bytes is not "
                         f"{header} header bytes + {count:,} {dtype.name} ids (raw uint16 as nanoGPT "
                         f"writes, or llm.c's {LLMC_HEADER_BYTES}-byte header, magic {LLMC_MAGIC})")
    if side and (side["tokens"] != count or side["header_bytes"] != header or side["dtype"] != dtype.name):
        raise ValueError(f"--corpus {path}: the file holds {count:,} {dtype.name} ids after {header} "
                         f"header bytes but its sidecar {sidecar_path(path).name} says "
                         f"{side['tokens']:,} {side['dtype']} ids after {side['header_bytes']}: "
                         "one of them is corrupt")
    return dtype, header, count


def _max_id(path: Path, dtype: np.dtype, header: int, chunk: int = 1 << 20) -> int:
    """The largest id in the file, read in chunks with plain reads (no pages stay mapped)."""
    top = 0
    with open(path, "rb") as f:
        f.seek(header)
        while block := f.read(chunk * dtype.itemsize):
            top = max(top, int(np.frombuffer(block, dtype).max()))
    return top


def read_token_file(path: str | os.PathLike) -> TokenFile:
    """The layout of a token file: from its sidecar where it has ours, else its llm.c header
    or raw uint16, cut into pseudo-documents of RAW_DOC_TOKENS ids named "FILE#INDEX"."""
    path = Path(path)
    side = None
    if sidecar_path(path).is_file():
        try:
            side = json.loads(sidecar_path(path).read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"--corpus {path}: corrupt sidecar {sidecar_path(path).name} ({e})") from None
        if side.get("format") != FORMAT:
            side = None  # somebody else's JSON: read the file as one without ours
    dtype, header, count = _layout(path, side)
    if side:
        return TokenFile(path, dtype, header, count, np.asarray(side["offsets"], np.int64),
                         tuple(side["documents"]), side["vocab_size"], side["max_id"],
                         side["tokenizer"], side["source"], side["bytes"])
    offsets = np.append(np.arange(0, count, RAW_DOC_TOKENS, dtype=np.int64), count)
    names = tuple(f"{path.name}#{i}" for i in range(len(offsets) - 1))
    return TokenFile(path, dtype, header, count, offsets, names, None, None, None,
                     {"name": f"tokens:{path}"}, sidecar=False)


def write_token_file(path: str | os.PathLike, docs: Documents, tokenizer: Tokenizer, *,
                     llmc_header: bool = False, tokenizer_file: str | None = None,
                     batch_bytes: int = 1 << 20) -> TokenFile:
    """Tokenize `docs` document by document into `path` and its sidecar, each written to a
    temporary file and renamed (a reader sees a whole file or none; the sidecar comes last).
    With `llmc_header` the file starts with llm.c's header (ids then at least uint16);
    `tokenizer_file` names the tokenizer.json saved beside it, if any."""
    path = Path(path)
    dtype = tokenizer.dtype.newbyteorder("<")
    if llmc_header:
        dtype = max(dtype, np.dtype("<u2"), key=lambda d: d.itemsize)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with open(tmp, "xb") as f:
            f.write(bytes(LLMC_HEADER_BYTES if llmc_header else 0))
            sizes, total_bytes, top = _write_ids(f, docs, tokenizer, dtype, batch_bytes)
            if not total_bytes:
                raise ValueError(f"--corpus {docs.name!r} is empty: its {len(docs.names)} "
                                 "documents hold no bytes")
            if llmc_header:
                f.seek(0)
                f.write(np.array([LLMC_MAGIC, 1 if dtype.itemsize == 2 else 2, int(sizes.sum())]
                                 + [0] * 253, "<i4").tobytes())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    side = {"format": FORMAT, "dtype": dtype.name, "header_bytes": LLMC_HEADER_BYTES if llmc_header else 0,
            "tokens": int(offsets[-1]), "vocab_size": tokenizer.vocab_size, "max_id": top,
            "bytes": total_bytes, "tokenizer": {**tokenizer.describe(), "file": tokenizer_file},
            "source": {"name": docs.name, "metadata": docs.metadata, "entropy_rate": docs.entropy_rate},
            "documents": list(docs.names), "offsets": offsets.tolist()}
    _write_json(sidecar_path(path), side)
    return read_token_file(path)


def _write_ids(f, docs: Documents, tokenizer: Tokenizer, dtype: np.dtype, batch_bytes: int):
    """Write every document's ids to `f`, a batch of about `batch_bytes` of text at a time;
    (ids per document, bytes read, largest id)."""
    sizes, total, top, batch = np.zeros(len(docs.names), np.int64), 0, 0, []

    def flush():
        nonlocal top
        for i, ids in zip([i for i, _ in batch], tokenizer.encode_many([d for _, d in batch])):
            sizes[i] = len(ids)
            top = max(top, int(ids.max()) if len(ids) else 0)
            f.write(ids.astype(dtype, copy=False).tobytes())
        batch.clear()

    for i in range(len(docs.names)):
        text = docs.read(i)
        total += len(text)
        batch.append((i, text))
        if sum(len(d) for _, d in batch) >= batch_bytes:
            flush()
    flush()
    return sizes, total, top


def _write_json(path: Path, obj: Any) -> None:
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)


def cache_dir() -> Path:
    """Where tokenized corpora are kept: $DILOCO_EQX_CACHE (default ~/.cache/diloco_eqx)/tokens."""
    root = Path(os.environ.get("DILOCO_EQX_CACHE", "~/.cache/diloco_eqx")).expanduser() / "tokens"
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"cannot create the token cache {root} ({e.strerror or e}); set "
                         "DILOCO_EQX_CACHE to a writable directory") from None
    return root


def cached_token_file(docs: Documents, tokenizer: Tokenizer) -> TokenFile:
    """`docs` tokenized by `tokenizer`, from the cache, written there first if missing."""
    key = hashlib.sha256(json.dumps([FORMAT, docs.fingerprint, tokenizer.identity]).encode()).hexdigest()
    path = cache_dir() / f"{key[:32]}.bin"
    if sidecar_path(path).is_file() and path.is_file():
        try:
            return read_token_file(path)
        except (ValueError, KeyError):
            pass  # damaged: write it again
    return write_token_file(path, docs, tokenizer)


def token_file_tokenizer(tf: TokenFile, spec: str = "bytes", saved: Tokenizer | None = None) -> Tokenizer:
    """The tokenizer of a run on token file `tf`: `saved` (a resumed run's), a --tokenizer
    tokenizer.json, else the one the file was made with (its sidecar's; the bare ids of a file
    without one). Its vocabulary must hold every id of the file."""
    kind, arg = tok_lib.parse_spec(spec)
    if saved is None and kind == "bpe":
        raise ValueError(f"--tokenizer {spec} trains a tokenizer on text, but --corpus {tf.path} is "
                         "already tokenized: leave --tokenizer out or give it the tokenizer.json "
                         "its ids come from")
    own = tf.tokenizer
    tok = saved or (tok_lib.load(arg) if kind == "file" else None)
    if tok is None and own:
        tok = _own_tokenizer(tf)
    top = tf.max_id if tf.max_id is not None else _max_id(tf.path, tf.dtype, tf.header_bytes)
    tok = tok or tok_lib.IdTokenizer(top + 1)
    if own and own["identity"] != tok.identity:
        raise ValueError(f"--corpus {tf.path} was tokenized with {own['spec']} ({own['identity']}), "
                         f"not with --tokenizer {tok.spec} ({tok.identity})")
    if top >= tok.vocab_size:
        raise ValueError(f"--corpus {tf.path} holds token id {top}, beyond the {tok.vocab_size} ids "
                         f"of the tokenizer ({tok.spec}): give --tokenizer the tokenizer.json its "
                         "ids come from")
    return tok


def _own_tokenizer(tf: TokenFile) -> Tokenizer:
    """The tokenizer a sidecar names: bytes, or the tokenizer.json saved beside the file."""
    own = tf.tokenizer
    if own["kind"] == "bytes":
        return BYTES
    if not own.get("file") or not tf.path.with_name(own["file"]).is_file():
        raise ValueError(f"--corpus {tf.path} was tokenized with {own['spec']} ({own['identity']}) "
                         "and its tokenizer.json is not beside it: give it with --tokenizer")
    return tok_lib.load(tf.path.with_name(own["file"]))


