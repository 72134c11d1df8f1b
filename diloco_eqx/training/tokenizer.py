"""Tokenizers: UTF-8 bytes, or a byte-level BPE trained on the run's training split.

One small interface (`Tokenizer`): encode text or bytes to ids, decode ids to text, the
vocabulary size, and `token_bytes`, the bytes each id stands for, which turns a held-out loss
per token into bits per byte. A BPE is trained with Hugging Face `tokenizers` (ByteLevel
pre-tokenizer and decoder, all 256 bytes in the initial alphabet, so every input encodes) and
saved as a plain `tokenizer.json` that `tokenizers.Tokenizer.from_file` loads too. Bytes that
are not valid UTF-8 keep their byte tokens, so `encode` is exact on any input.

`from_spec("bytes" | "bpe:N" | PATH.json, texts=...)` makes one, `for_run(run_dir)` gives the
one a run trained with, and `from_process_0` gives every process of a multi-process run the
tokenizer process 0 made (its JSON passed through the distributed key-value store).
"""

from __future__ import annotations

import abc
import functools
import hashlib
import json
import math
import os
import re
import zlib
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from jaxtyping import Int

LN2 = math.log(2)
SPEC_FORMS = "bytes, bpe:N (a byte-level BPE of vocabulary N > 256) or a tokenizer.json path"
_INVALID_UTF8 = re.compile("([\udc80-\udcff]+)")  # bytes that are not UTF-8, as surrogateescape writes them


def parse_spec(spec: str) -> tuple[str, Any]:
    """("bytes", None), ("bpe", N) or ("file", path) for a --tokenizer value; ValueError
    naming the flag and its allowed forms otherwise."""
    if spec == "bytes":
        return "bytes", None
    if spec.startswith("bpe:"):
        n = spec[4:]
        if not n.isdigit() or int(n) <= 256:
            raise ValueError(f"--tokenizer {spec}: N of bpe:N must be an integer above 256 (the "
                             f"byte alphabet); --tokenizer takes {SPEC_FORMS}")
        return "bpe", int(n)
    if spec.endswith(".json"):
        if not Path(spec).expanduser().is_file():
            raise ValueError(f"--tokenizer {spec}: no such file; --tokenizer takes {SPEC_FORMS}")
        return "file", Path(spec).expanduser()
    raise ValueError(f"--tokenizer {spec!r}: unknown; --tokenizer takes {SPEC_FORMS}")


def token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest unsigned dtype that holds every id: uint8, uint16 or uint32."""
    return np.dtype(np.uint8 if vocab_size <= 256 else np.uint16 if vocab_size <= 65536 else np.uint32)


@functools.cache
def byte_chars() -> tuple[str, ...]:
    """The printable character ByteLevel BPE writes for each byte 0..255 (GPT-2's table)."""
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    extra = iter(range(256, 512))
    return tuple(chr(b) if b in keep else chr(next(extra)) for b in range(256))


class Tokenizer(abc.ABC):
    """Text <-> token ids, the vocabulary, and the bytes each id stands for."""

    spec: str
    """How the tokenizer was asked for ("bytes", "bpe:N"); recorded in run.json."""
    kind: str
    """bytes | bpe | ids."""

    @property
    @abc.abstractmethod
    def vocab_size(self) -> int:
        """Ids run over 0..vocab_size-1: the model's vocabulary."""

    @abc.abstractmethod
    def encode_many(self, docs: Sequence[bytes]) -> list[Int[np.ndarray, " n"]]:
        """Each document's ids (dtype `self.dtype`)."""

    @abc.abstractmethod
    def decode(self, ids: Int[np.ndarray, " n"]) -> str:
        """The text of `ids` (bytes that are not UTF-8 become U+FFFD)."""

    @property
    @abc.abstractmethod
    def token_bytes(self) -> Int[np.ndarray, " V"] | None:
        """Bytes of text each id decodes to (0 for special tokens); None if unknown."""

    @abc.abstractmethod
    def to_json(self) -> str:
        """A tokenizer.json that `load` (and Hugging Face `tokenizers`) reads back."""

    @property
    def dtype(self) -> np.dtype:
        """The dtype of token files in these ids."""
        return token_dtype(self.vocab_size)

    def encode(self, text: str | bytes) -> Int[np.ndarray, " n"]:
        """The ids of one text (a str is encoded as UTF-8 first)."""
        return self.encode_many([text.encode("utf-8") if isinstance(text, str) else bytes(text)])[0]

    @property
    def identity(self) -> str:
        """Names exactly this tokenizer (cache keys, token files): kind, vocabulary and a hash
        of its tokenizer.json."""
        return f"{self.kind}:{self.vocab_size}:{hashlib.sha256(self.to_json().encode()).hexdigest()[:16]}"

    def describe(self) -> dict[str, Any]:
        """run.json's record of the tokenizer."""
        return {"spec": self.spec, "kind": self.kind, "vocab_size": self.vocab_size,
                "identity": self.identity}

    def save(self, path: str | os.PathLike) -> None:
        """Write `to_json()` so that a reader never sees half a file."""
        path = Path(path)
        tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
        tmp.write_text(self.to_json())
        os.replace(tmp, path)


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes are the tokens (vocabulary 256)."""

    spec = kind = "bytes"

    @property
    def vocab_size(self) -> int:
        return 256

    def encode_many(self, docs: Sequence[bytes]) -> list[Int[np.ndarray, " n"]]:
        return [np.frombuffer(bytes(d), np.uint8).copy() for d in docs]

    def decode(self, ids) -> str:
        return bytes(np.asarray(ids, np.uint8)).decode("utf-8", errors="replace")

    @property
    def token_bytes(self) -> Int[np.ndarray, " V"]:
        return np.ones(256, np.int64)

    def to_json(self) -> str:
        """A byte-level BPE with no merges whose id b is byte b: the same tokenizer."""
        from tokenizers import Tokenizer as HF, decoders, models, pre_tokenizers

        hf = HF(models.BPE({c: b for b, c in enumerate(byte_chars())}, []))
        hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        hf.decoder = decoders.ByteLevel()
        return hf.to_str()

    @property
    def identity(self) -> str:
        return "bytes"


class IdTokenizer(Tokenizer):
    """The ids of a pre-tokenized corpus whose tokenizer is not known: a vocabulary, no text."""

    kind = "ids"

    def __init__(self, vocab_size: int):
        self._vocab, self.spec = vocab_size, f"ids:{vocab_size}"

    @property
    def vocab_size(self) -> int:
        return self._vocab

    def encode_many(self, docs):
        raise ValueError(f"token ids of an unknown tokenizer ({self.spec}) cannot encode text")

    def decode(self, ids) -> str:
        raise ValueError(f"token ids of an unknown tokenizer ({self.spec}) cannot be decoded; "
                         "give --tokenizer the tokenizer.json they were made with")

    @property
    def token_bytes(self) -> None:
        return None

    def to_json(self) -> str:
        return json.dumps({"ids": self._vocab})

    @property
    def identity(self) -> str:
        return self.spec


class BPETokenizer(Tokenizer):
    """A byte-level BPE: a Hugging Face tokenizer with the ByteLevel pre-tokenizer."""

    kind = "bpe"

    def __init__(self, hf, spec: str | None = None):
        self._hf = hf
        self.spec = spec or f"bpe:{hf.get_vocab_size()}"
        self._table = _byte_table(hf)
        byte_ids = [hf.token_to_id(c) for c in byte_chars()]
        if None in byte_ids:
            raise ValueError("its vocabulary lacks some of the 256 byte tokens: --tokenizer takes "
                             "a byte-level BPE tokenizer.json")
        self._byte_ids = np.array(byte_ids, np.int64)

    @functools.cached_property
    def identity(self) -> str:
        return super().identity

    @property
    def vocab_size(self) -> int:
        return self._hf.get_vocab_size()

    def encode_many(self, docs: Sequence[bytes]) -> list[Int[np.ndarray, " n"]]:
        """Valid UTF-8 runs through the BPE (in one parallel batch), other bytes as byte tokens."""
        pieces = [_INVALID_UTF8.split(bytes(d).decode("utf-8", errors="surrogateescape")) for d in docs]
        texts = [p for parts in pieces for p in parts[::2] if p]
        encoded = iter(self._hf.encode_batch(texts, add_special_tokens=False))
        out = []
        for parts in pieces:
            ids: list[int] = []
            for i, part in enumerate(parts):
                if i % 2:  # surrogate \udcXX stands for byte XX
                    ids.extend(self._byte_ids[[ord(c) - 0xDC00 for c in part]].tolist())
                elif part:
                    ids.extend(next(encoded).ids)
            out.append(np.array(ids, self.dtype))
        return out

    def decode(self, ids) -> str:
        return self._hf.decode(np.asarray(ids).tolist(), skip_special_tokens=False)

    @property
    def token_bytes(self) -> Int[np.ndarray, " V"]:
        return self._table

    def to_json(self) -> str:
        return self._hf.to_str()


def _byte_table(hf) -> Int[np.ndarray, " V"]:
    """Bytes each id of a ByteLevel BPE stands for; special tokens stand for none."""
    char_byte = {c: b for b, c in enumerate(byte_chars())}
    table = np.zeros(hf.get_vocab_size(), np.int64)
    special = {i for i, t in hf.get_added_tokens_decoder().items() if t.special}
    for token, i in hf.get_vocab(with_added_tokens=True).items():
        if i in special:
            continue
        if any(c not in char_byte for c in token):
            raise ValueError(f"token {token!r} is not written in ByteLevel characters: --tokenizer "
                             "takes a byte-level BPE tokenizer.json")
        table[i] = len(token)
    return table


def train_bpe(texts: Iterable[bytes], vocab_size: int) -> BPETokenizer:
    """A byte-level BPE of `vocab_size` ids (fewer if the texts run out of merges) trained on
    `texts`, one document at a time; deterministic for identical input."""
    from tokenizers import Tokenizer as HF, decoders, models, pre_tokenizers, trainers

    hf = HF(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False, special_tokens=[],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    valid = ([p for p in _INVALID_UTF8.split(t.decode("utf-8", errors="surrogateescape"))[::2] if p]
             for t in texts)
    hf.train_from_iterator(valid, trainer)
    return BPETokenizer(hf, f"bpe:{vocab_size}")


def from_json(text: str) -> Tokenizer:
    """The tokenizer a `to_json()` wrote (the identity-byte BPE comes back as bytes)."""
    from tokenizers import Tokenizer as HF

    if text.startswith('{"ids"'):
        return IdTokenizer(json.loads(text)["ids"])
    try:
        hf = HF.from_str(text)
    except Exception as e:
        raise ValueError(f"not a tokenizer.json ({e})") from None
    if text == BYTES.to_json():
        return BYTES
    return BPETokenizer(hf)


def load(path: str | os.PathLike) -> Tokenizer:
    """The tokenizer saved in a tokenizer.json (ours, or any byte-level BPE's)."""
    try:
        return from_json(Path(path).read_text())
    except ValueError as e:
        raise ValueError(f"--tokenizer {path}: {e}") from None


def from_spec(spec: str, texts: Callable[[], Iterable[bytes]] | None = None) -> Tokenizer:
    """The tokenizer --tokenizer asks for; bpe:N is trained on `texts()` (the training split)."""
    kind, arg = parse_spec(spec)
    if kind == "bytes":
        return BYTES
    if kind == "file":
        return load(arg)
    if texts is None:
        raise ValueError(f"--tokenizer {spec} trains on text, and there is none to train on")
    return train_bpe(texts(), arg)


def for_run(run_dir: str | os.PathLike) -> Tokenizer:
    """The tokenizer of the run in `run_dir`: its tokenizer.json, else (bytes, or the ids of a
    pre-tokenized corpus) what its run.json records."""
    run_dir = Path(run_dir)
    if (run_dir / "tokenizer.json").is_file():
        return load(run_dir / "tokenizer.json")
    try:
        meta = json.loads((run_dir / "run.json").read_text())
    except FileNotFoundError:
        raise ValueError(f"{run_dir} holds no run (no run.json, no tokenizer.json)") from None
    info = meta.get("tokenizer") or {"spec": meta.get("settings", {}).get("tokenizer", "bytes")}
    if info.get("kind") == "ids":
        return IdTokenizer(info["vocab_size"])
    if info["spec"] != "bytes":
        raise ValueError(f"the run in {run_dir} used --tokenizer {info['spec']} but its "
                         "tokenizer.json is missing")
    return BYTES


KV_KEY, KV_CHUNK, KV_WAIT_MS = "diloco_eqx/tokenizer", 1 << 20, 3_600_000


def from_process_0(make: Callable[[], Tokenizer]) -> Tokenizer:
    """In a multi-process run, process 0's `make()`, on every process: process 0 publishes its
    tokenizer.json (compressed, in 1 MiB pieces) in the distributed key-value store and the
    others wait for it, so all train with one tokenizer whatever their inputs or library
    versions. (A peer that never publishes is found by the run's heartbeat watch.)"""
    import jax
    from jax._src import distributed

    client = distributed.global_state.client
    if jax.process_index() == 0:
        tok = make()
        blob = zlib.compress(tok.to_json().encode())
        pieces = [blob[i : i + KV_CHUNK] for i in range(0, len(blob), KV_CHUNK)]
        for i, piece in enumerate(pieces):
            client.key_value_set_bytes(f"{KV_KEY}/{i}", piece)
        client.key_value_set(f"{KV_KEY}/pieces", str(len(pieces)))
        return tok
    n = int(client.blocking_key_value_get(f"{KV_KEY}/pieces", KV_WAIT_MS))
    blob = b"".join(client.blocking_key_value_get_bytes(f"{KV_KEY}/{i}", KV_WAIT_MS) for i in range(n))
    return from_json(zlib.decompress(blob).decode())


def bytes_per_token(tokenizer: Tokenizer, batches: Sequence[np.ndarray]) -> float | None:
    """Mean bytes the target tokens (each row's [1:]) of `batches` decode to; None if the
    tokenizer does not know its tokens' bytes."""
    table = tokenizer.token_bytes
    if table is None:
        return None
    targets = sum(b[:, 1:].size for b in batches)
    return float(sum(int(table[b[:, 1:]].sum()) for b in batches)) / targets


def bits_per_byte(nats_per_token: float, mean_bytes_per_token: float) -> float:
    """Total nats over the targets / (ln 2 · the bytes they decode to)."""
    return nats_per_token / LN2 / mean_bytes_per_token


BYTES = ByteTokenizer()
