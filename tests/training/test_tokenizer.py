"""Tokenizers: specs, the byte-level BPE (exact on any bytes, trained on the training split
only, saved and reloaded), bits per byte, a run's tokenizer, and one tokenizer for every
process of a multi-process run."""

import json
import math
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from diloco_eqx.training import cli, data, runner
from diloco_eqx.training import tokenizer as T
from tests.helpers import subprocess_env

ROOT = Path(__file__).resolve().parents[2]
TEXT = ("def add(a, b):\n    return a + b\n\n" * 40 + "class Point:\n    x: int = 0\n" * 30
        + "# café ✓ naïve\n" * 20)


@pytest.fixture(autouse=True)
def token_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DILOCO_EQX_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def bpe():
    return T.train_bpe([TEXT.encode()], 300)


def test_specs_and_their_errors(tmp_path, capsys):
    assert T.parse_spec("bytes") == ("bytes", None) and T.parse_spec("bpe:4096") == ("bpe", 4096)
    (tmp_path / "t.json").write_text(T.BYTES.to_json())
    assert T.parse_spec(str(tmp_path / "t.json")) == ("file", tmp_path / "t.json")
    for bad in ("bpe:abc", "bpe:100", "bpe:256", "wordpiece", str(tmp_path / "none.json")):
        with pytest.raises(ValueError, match=r"--tokenizer .*--tokenizer takes bytes, bpe:N"):
            T.parse_spec(bad)
    for bad in ("bpe:abc", "bpe:100"):
        with pytest.raises(SystemExit) as e:
            cli.parse_settings(["--tokenizer", bad, "--out", str(tmp_path / "run")])
        assert e.value.code == 2
        assert f"--tokenizer {bad}: N of bpe:N must be an integer above 256" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()
    assert [T.token_dtype(v) for v in (256, 257, 65536, 65537)] == [np.uint8, np.uint16, np.uint16, np.uint32]


def test_bpe_is_exact_on_any_bytes_and_its_table_counts_them(bpe):
    assert bpe.vocab_size == 300 and bpe.dtype == np.uint16
    samples = [TEXT[:500].encode(), "naïve café ✓ 😀".encode(), b"ok \xff\xfe\x80 then \xc3", bytes(range(256))]
    for raw in samples:
        ids = bpe.encode(raw)
        # independent: the tokens' own strings in ByteLevel characters, mapped back to bytes
        inverse = {c: b for b, c in enumerate(T.byte_chars())}
        pieces = [bytes(inverse[c] for c in bpe._hf.id_to_token(int(i))) for i in ids]
        assert b"".join(pieces) == raw
        assert int(bpe.token_bytes[ids].sum()) == len(raw)
    assert len(bpe.encode(TEXT)) < len(TEXT.encode()) / 2  # the merges compress the text it saw
    assert bpe.decode(bpe.encode(TEXT)) == TEXT
    assert sorted(bpe.token_bytes[bpe._byte_ids].tolist()) == [1] * 256
    assert bpe.token_bytes.max() > 4


def test_bpe_training_is_deterministic(bpe):
    again = T.train_bpe([TEXT.encode()], 300)
    assert again.to_json() == bpe.to_json() and again.identity == bpe.identity
    other = T.train_bpe([TEXT.encode()[::-1]], 300)
    assert other.identity != bpe.identity


def test_save_load_and_for_run(bpe, tmp_path):
    import tokenizers

    bpe.save(tmp_path / "tokenizer.json")
    loaded = T.for_run(tmp_path)
    assert loaded.identity == bpe.identity and np.array_equal(loaded.encode(TEXT), bpe.encode(TEXT))
    hf = tokenizers.Tokenizer.from_file(str(tmp_path / "tokenizer.json"))  # any tool reads it
    assert hf.encode(TEXT[:200]).ids == bpe.encode(TEXT[:200]).tolist()
    # bytes: its tokenizer.json is Hugging Face's own byte-level BPE with id b = byte b
    (tmp_path / "bytes.json").write_text(T.BYTES.to_json())
    assert tokenizers.Tokenizer.from_file(str(tmp_path / "bytes.json")).encode("aé").ids == [97, 195, 169]
    assert T.load(tmp_path / "bytes.json") is T.BYTES
    run = tmp_path / "run"
    run.mkdir()
    (run / "run.json").write_text(json.dumps({"settings": {"tokenizer": "bytes"}}))
    assert T.for_run(run) is T.BYTES
    (run / "run.json").write_text(json.dumps({"settings": {}, "tokenizer": {"kind": "ids", "vocab_size": 50257}}))
    assert T.for_run(run).vocab_size == 50257 and T.for_run(run).token_bytes is None
    (run / "run.json").write_text(json.dumps({"settings": {"tokenizer": "bpe:300"}}))
    with pytest.raises(ValueError, match="used --tokenizer bpe:300 but its tokenizer.json is missing"):
        T.for_run(run)
    with pytest.raises(ValueError, match="holds no run"):
        T.for_run(tmp_path / "nothing")


def test_bits_per_byte_is_nats_over_ln2_times_the_targets_bytes(bpe):
    rows = np.stack([bpe.encode(TEXT)[i : i + 17] for i in range(0, 160, 20)]).astype(np.int32)
    batches = [rows[:4], rows[4:]]
    nats = 1.7  # a held-out loss per token
    # by hand: each target token's bytes from decoding it (ASCII-or-whole-character tokens here)
    targets = sum(b[:, 1:].size for b in batches)
    total_bytes = sum(len(bpe.decode(r[1:]).encode()) for b in batches for r in b)
    assert total_bytes > targets  # tokens of several bytes
    got = T.bits_per_byte(nats, T.bytes_per_token(bpe, batches))
    assert got == pytest.approx(nats * targets / (math.log(2) * total_bytes), rel=1e-12)
    byte_rows = [np.random.default_rng(0).integers(0, 256, (4, 17))]
    assert T.bits_per_byte(nats, T.bytes_per_token(T.BYTES, byte_rows)) == nats / math.log(2)
    assert T.bytes_per_token(T.IdTokenizer(1000), byte_rows) is None


def test_run_corpus_trains_bpe_on_the_training_split_only(tmp_path, monkeypatch):
    """A word that only the held-out documents hold never becomes a token; the trained
    tokenizer is the corpus's, cached, and a saved one is used as it is (not retrained)."""
    source = Path(json.__file__).with_name("decoder.py").read_text()  # varied Python text
    assert "qj" not in source
    names = [str(tmp_path / f"doc{i:02d}.py") for i in range(40)]
    _, held = data.split_names(names)
    for i, name in enumerate(names):
        Path(name).write_text("qjqjqj " * 300 if i in held else source[i * 250 :])
    corpus = runner.load_corpus((str(tmp_path / "*.py"),), "bpe:400")
    tok = corpus.tokenizer
    assert tok.vocab_size == 400 and corpus.vocab_size == 400 and isinstance(corpus.tokens, np.memmap)
    assert not [t for t in tok._hf.get_vocab() if "qj" in t or "jq" in t]  # held-out text unseen
    assert "Ġreturn" in tok._hf.get_vocab()
    for d in (0, 1, held[0]):  # each document is its own encoding
        doc = corpus.tokens[corpus.offsets[d] : corpus.offsets[d + 1]]
        np.testing.assert_array_equal(doc, tok.encode(Path(names[d]).read_bytes()))
    tok.save(tmp_path / "tokenizer.json")
    monkeypatch.setattr(T, "train_bpe", lambda *a: pytest.fail("a saved tokenizer is not retrained"))
    again = runner.load_corpus((str(tmp_path / "*.py"),), "bpe:400", saved=tmp_path / "tokenizer.json")
    assert again.tokenizer.identity == tok.identity and again.metadata["token_file"] == corpus.metadata["token_file"]


SHARE = textwrap.dedent("""
    import sys, jax
    from diloco_eqx.training import tokenizer as T
    port, pid = sys.argv[1], int(sys.argv[2])
    jax.distributed.initialize(f"localhost:{port}", 2, pid)
    text = open(sys.argv[3], "rb").read()
    make = (lambda: T.train_bpe([text], 600)) if pid == 0 else (lambda: 1 / 0)  # only 0 makes it
    shared = T.from_process_0(make)
    print(shared.identity, T.train_bpe([text], 600).identity, shared.vocab_size)
""")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def test_every_process_gets_process_0s_tokenizer(tmp_path):
    """Two processes on jax.distributed: process 1 receives process 0's tokenizer through
    the key-value store; each training it from the same text gets the same one too."""
    (tmp_path / "text").write_bytes(TEXT.encode() * 3)
    port, env = free_port(), subprocess_env()
    procs = [subprocess.Popen([sys.executable, "-c", SHARE, str(port), str(i), str(tmp_path / "text")],
                              cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in (1, 0)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs[0][1][-2000:] + outs[1][1][-2000:]
    expected = T.train_bpe([TEXT.encode() * 3], 600).identity
    lines = [o.split() for o, _ in outs]
    assert all(line[:2] == [expected, expected] for line in lines), lines


@pytest.mark.slow  # two end-to-end training runs
def test_a_bpe_run_saves_its_tokenizer_reports_bits_per_byte_and_resumes_with_it(tmp_path, monkeypatch):
    import hashlib
    import shutil

    from experiments import train

    source = Path(json.__file__).with_name("decoder.py").read_text() * 3
    (tmp_path / "in").mkdir()
    for i in range(16):
        (tmp_path / "in" / f"part{i:02d}.py").write_text(source[i * 1500 : i * 1500 + 6000])
    out = tmp_path / "run"
    args = ["--corpus", str(tmp_path / "in"), "--tokenizer", "bpe:320", "--layers", "2", "--width", "32",
            "--heads", "2", "--seq-len", "32", "--global-batch", "4", "--no-progress", "--steps", "8",
            "--eval-every", "4", "--checkpoint-every", "4", "--out", str(out)]
    assert train.main(args) == 0
    tok, digest = T.for_run(out), hashlib.sha256((out / "tokenizer.json").read_bytes()).hexdigest()
    meta = json.loads((out / "run.json").read_text())
    assert meta["tokenizer"]["identity"] == tok.identity and meta["model"]["vocab_size"] == tok.vocab_size == 320
    first = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r.get("eval")]
    # bits per byte, independently: the held-out targets' bytes from their tokens' own strings
    corpus = data.Corpus.from_files([str(tmp_path / "in")], tok)
    held = data.eval_batches(corpus, corpus.split()[1], seq_len=32, batch_size=4, max_batches=8)
    inverse = {c: b for b, c in enumerate(T.byte_chars())}
    total = sum(len(tok._hf.id_to_token(int(i))) for b in held for i in b[:, 1:].ravel())
    assert all(c in inverse for b in held for i in b[:, 1:].ravel() for c in tok._hf.id_to_token(int(i)))
    targets = sum(b[:, 1:].size for b in held)
    for r in first:
        assert r["eval_bits_per_byte"] == pytest.approx(r["eval_loss"] * targets / (math.log(2) * total), rel=1e-9)
    assert meta["summary"]["eval_bits_per_byte"] == pytest.approx(first[-1]["eval_bits_per_byte"], rel=1e-6)
    # resume from step 4 with the saved tokenizer: not retrained, the same numbers
    shutil.rmtree(out / "checkpoints" / "8")
    monkeypatch.setattr(T, "train_bpe", lambda *a: pytest.fail("--resume retrained the tokenizer"))
    assert train.main([*args, "--resume"]) == 0
    again = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r.get("eval")]
    assert hashlib.sha256((out / "tokenizer.json").read_bytes()).hexdigest() == digest
    assert [r["step"] for r in again] == [4, 8]
    assert again[-1]["eval_loss"] == pytest.approx(first[-1]["eval_loss"], rel=1e-6)


@pytest.mark.slow  # end to end: three training processes
def test_two_processes_train_with_process_0s_bpe_like_one(tmp_path):
    """A 2-process BPE run: one tokenizer.json (process 0's), and the per-step losses of the
    same run in one process."""
    from tests.experiments import test_multiprocess as mp

    source = Path(json.__file__).with_name("decoder.py").read_text() * 3
    (tmp_path / "in").mkdir()
    for i in range(16):
        (tmp_path / "in" / f"part{i:02d}.py").write_text(source[i * 1500 : i * 1500 + 6000])
    args = [*mp.TINY[: mp.TINY.index("--corpus")], "--corpus", str(tmp_path / "in"), "--no-progress",
            "--tokenizer", "bpe:320", "--steps", "6", "--eval-every", "6", "--checkpoint-every", "6"]
    procs = mp.launch_pair(args, tmp_path / "two", tmp_path, "p")
    assert [p.wait(timeout=300) for p in procs] == [0, 0], (tmp_path / "p0.log").read_text()[-2000:]
    mp.single(args, tmp_path / "one")
    assert (tmp_path / "two" / "tokenizer.json").read_text() == (tmp_path / "one" / "tokenizer.json").read_text()
    (steps2, l2), (steps1, l1) = mp.losses(tmp_path / "two"), mp.losses(tmp_path / "one")
    assert steps2 == steps1 and len(steps1) == 6 + 1
    np.testing.assert_allclose(l2, l1, rtol=1e-6)
