"""Data: tokenizer, corpora, the held-out split, windows, island shards, iterator state."""

import math
import sys

import numpy as np
import pytest

from diloco_eqx.training import data, sources, token_files
from diloco_eqx.training.tokenizer import BYTES


@pytest.fixture(scope="module", autouse=True)
def token_cache(tmp_path_factory):
    """Tokenized corpora go to a cache of this module's own."""
    with pytest.MonkeyPatch.context() as mp:
        path = tmp_path_factory.mktemp("cache")
        mp.setenv("DILOCO_EQX_CACHE", str(path))
        yield path


def test_byte_tokenizer_round_trip():
    text = "def f(x):\n    return x ** 2  # café ✓\n"
    tokens = BYTES.encode(text)
    assert tokens.dtype == np.uint8 and len(tokens) == len(text.encode())
    assert BYTES.decode(tokens) == text


@pytest.fixture(scope="module")
def stdlib():
    return data.Corpus.stdlib()


def test_stdlib_corpus_is_deterministic_and_described(stdlib):
    again = data.Corpus.stdlib()
    assert stdlib.doc_names == again.doc_names and np.array_equal(stdlib.tokens, again.tokens)
    assert list(stdlib.doc_names) == sorted(stdlib.doc_names)
    assert stdlib.metadata["python_version"] == ".".join(map(str, sys.version_info[:3]))
    assert stdlib.metadata["bytes"] == len(stdlib.tokens) > 5_000_000
    assert all("site-packages" not in n for n in stdlib.doc_names)
    assert "os.py" in stdlib.doc_names


def test_split_is_by_file_and_fixed(stdlib):
    train, held = stdlib.split()
    assert len(set(train) & set(held)) == 0 and len(train) + len(held) == stdlib.num_docs
    assert 0.005 < len(held) / stdlib.num_docs < 0.05
    train2, held2 = stdlib.split()
    assert np.array_equal(held, held2)
    # windows never cross a document boundary
    starts = stdlib.windows(held, 129)
    doc_of = np.searchsorted(stdlib.offsets, starts, side="right") - 1
    assert np.all(starts + 129 <= stdlib.offsets[doc_of + 1])
    assert set(doc_of) <= set(held)


def labelled_corpus(n_docs=8, size=700):
    """Document i is `size` bytes all equal to i: a row's tokens name its document."""
    return data.Corpus.from_documents("labelled", [(f"d{i}", bytes([i]) * size) for i in range(n_docs)])


def test_global_batches_have_disjoint_island_shards_and_follow_the_seed():
    corpus = data.Corpus.markov(num_bytes=300_000, seed=3, doc_bytes=10_000)
    train, _ = corpus.split()
    ds = data.train_batches(corpus, train, seq_len=31, global_batch=8, num_islands=4, seed=1)
    for i in range(30):
        batch = ds[i]
        assert batch.shape == (8, 32) and batch.dtype == np.int32
        rows = {row.tobytes() for row in batch}
        assert len(rows) == 8  # every row a different window: island shards are disjoint
    same = data.train_batches(corpus, train, seq_len=31, global_batch=8, num_islands=4, seed=1)
    other = data.train_batches(corpus, train, seq_len=31, global_batch=8, num_islands=4, seed=2)
    assert all(np.array_equal(ds[i], same[i]) for i in range(10))
    assert not all(np.array_equal(ds[i], other[i]) for i in range(10))


def test_non_iid_islands_only_see_their_own_files():
    corpus = labelled_corpus()
    train = np.arange(8)
    blocks = data.island_documents(corpus, train, 2)
    assert [list(b) for b in blocks] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    ds = data.train_batches(corpus, train, seq_len=9, global_batch=6, num_islands=2, seed=0,
                            non_iid=True)
    seen = [set(), set()]
    for i in range(50):
        batch = ds[i]
        for k in range(2):
            shard = batch[k * 3:(k + 1) * 3]
            assert np.all(shard == shard[:, :1])  # each row lies inside one document
            seen[k] |= set(shard[:, 0].tolist())
    assert seen[0] == {0, 1, 2, 3} and seen[1] == {4, 5, 6, 7}
    iid = data.train_batches(corpus, train, seq_len=9, global_batch=6, num_islands=2, seed=0)
    assert {int(x) for i in range(50) for x in iid[i][:3, 0]} == set(range(8))


def test_iterator_state_restores_the_position():
    corpus = data.Corpus.markov(num_bytes=100_000, seed=1, doc_bytes=5_000)
    train, _ = corpus.split()
    ds = data.train_batches(corpus, train, seq_len=15, global_batch=4, num_islands=2, seed=0)
    it = iter(ds.to_iter_dataset())
    for _ in range(7):
        next(it)
    state = it.get_state()
    expected = [next(it) for _ in range(5)]
    fresh = iter(ds.to_iter_dataset())
    fresh.set_state(state)
    assert all(np.array_equal(next(fresh), e) for e in expected)


def test_markov_corpus_has_its_stated_entropy_rate():
    corpus = data.Corpus.markov(num_bytes=400_000, branching=4, seed=0)
    assert corpus.entropy_rate == pytest.approx(math.log(4))
    tokens = corpus.tokens.astype(np.int64)
    pairs = np.bincount(tokens[:-1] * 256 + tokens[1:], minlength=256 * 256).reshape(256, 256)
    pairs = pairs[pairs.sum(1) > 100]
    p = pairs / pairs.sum(1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        h = -np.nansum(np.where(p > 0, p * np.log(p), 0.0), axis=1)
    assert np.mean(h) == pytest.approx(math.log(4), abs=0.02)
    assert np.all((pairs > 0).sum(1) <= 4 + 1)  # +1: document boundaries join two chains


def test_unigram_entropy():
    corpus = data.Corpus.from_documents("two", [("a", b"ab" * 50), ("b", b"aaaa")])
    assert corpus.unigram_entropy([0]) == pytest.approx(math.log(2))
    assert corpus.unigram_entropy([1]) == 0.0


def test_corpus_errors(tmp_path):
    with pytest.raises(ValueError, match=r"corpus path '.*nope\*' matches no file"):
        data.Corpus.from_files([str(tmp_path / "nope*")])
    (tmp_path / "empty.txt").write_bytes(b"")
    (tmp_path / "empty2.txt").write_bytes(b"")
    with pytest.raises(ValueError, match="is empty"):
        data.Corpus.from_files([str(tmp_path / "empty*.txt")])
    with pytest.raises(ValueError, match="give at least 2 files"):
        data.Corpus.from_documents("one", [("a", b"x" * 100)]).split()
    corpus = labelled_corpus(n_docs=4, size=50)
    with pytest.raises(ValueError, match=r"seq_len=63 leaves 0 windows of 64 tokens .*longest document: 50 tokens"):
        data.train_batches(corpus, np.arange(4), seq_len=63, global_batch=2, num_islands=2, seed=0)
    with pytest.raises(ValueError, match=r"global batch size \(GBS\)=3 must be divisible by num_replicas \(K\)=2"):
        data.train_batches(corpus, np.arange(4), seq_len=7, global_batch=3, num_islands=2, seed=0)
    with pytest.raises(ValueError, match="no held-out document is longer than 64 tokens"):
        data.eval_batches(corpus, np.arange(1), seq_len=63, batch_size=2, max_batches=2)


def test_files_corpus_reads_globs_and_directories(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.txt").write_text("hello")
    (tmp_path / "sub" / "b.txt").write_text("world!")
    corpus = data.Corpus.from_files([str(tmp_path / "*.txt"), str(tmp_path / "sub")])
    assert corpus.num_docs == 2 and corpus.metadata["bytes"] == 11


def test_eval_batches_are_fixed():
    corpus = data.Corpus.markov(num_bytes=100_000, seed=1, doc_bytes=5_000)
    _, held = corpus.split(0.2)
    a = data.eval_batches(corpus, held, seq_len=15, batch_size=4, max_batches=3)
    b = data.eval_batches(corpus, held, seq_len=15, batch_size=4, max_batches=3)
    assert len(a) == 3 and all(x.shape == (4, 16) for x in a)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("non_iid", [False, True])
def test_process_rows_are_the_matching_slice_of_the_global_batch(non_iid):
    """A process that loads rows lo..hi-1 gets exactly those rows of every global batch."""
    corpus = data.Corpus.markov(num_bytes=200_000, seed=0, doc_bytes=5_000)
    train, _ = corpus.split()
    kw = dict(seq_len=16, global_batch=8, num_islands=4, seed=5, non_iid=non_iid)
    full = data.train_batches(corpus, train, **kw)
    for lo, hi in [(0, 4), (4, 8), (2, 6), (6, 8)]:
        part = data.train_batches(corpus, train, rows=(lo, hi), **kw)
        for i in (0, 1, 37, 500):
            np.testing.assert_array_equal(part[i], full[i][lo:hi])
    with pytest.raises(ValueError, match=r"rows must be a range inside 0..8"):
        data.train_batches(corpus, train, rows=(4, 9), **kw)


def test_binary_files_are_skipped_and_counted(tmp_path):
    (tmp_path / "a.txt").write_text("print('hello')\n" * 20)
    (tmp_path / "b.txt").write_text("x = 1\n" * 30)
    (tmp_path / "tool").write_bytes(b"\x7fELF\x02\x01\x01\x00" + bytes(range(256)) * 4)
    with pytest.warns(UserWarning, match=r"skipped 1 binary file\(s\) \(1,032 bytes.*kept 2 text"):
        corpus = data.Corpus.from_files([str(tmp_path)])
    assert corpus.num_docs == 2 and corpus.metadata["skipped_binary_files"] == 1
    assert corpus.metadata["bytes"] == 15 * 20 + 6 * 30
    with pytest.raises(ValueError, match="holds only binary files"):
        data.Corpus.from_files([str(tmp_path / "tool")])


# ------------------------------------------------------------- the token cache and token files


def _cached(cache):
    """The token cache's entries; none before a corpus first writes there (this test may run
    first on its worker, or alone)."""
    return set((cache / "tokens").iterdir()) if (cache / "tokens").exists() else set()


def test_text_corpora_are_tokenized_once_into_the_cache_and_memory_mapped(tmp_path, token_cache):
    (tmp_path / "a.txt").write_text("hello world\n" * 50)
    (tmp_path / "b.txt").write_text("good bye ✓\n" * 40)
    before = _cached(token_cache)
    corpus = data.Corpus.from_files([str(tmp_path / "*.txt")])
    written = _cached(token_cache) - before
    assert sorted(p.suffix for p in written) == [".bin", ".json"] and not list(tmp_path.glob("*.tmp"))
    assert isinstance(corpus.tokens, np.memmap) and corpus.tokens.dtype == np.uint8
    expected = np.frombuffer((tmp_path / "a.txt").read_bytes() + (tmp_path / "b.txt").read_bytes(), np.uint8)
    np.testing.assert_array_equal(corpus.tokens, expected)
    assert corpus.offsets.tolist() == [0, 600, 600 + len("good bye ✓\n".encode()) * 40]
    again = data.Corpus.from_files([str(tmp_path / "*.txt")])
    assert again.metadata["token_file"] == corpus.metadata["token_file"]  # reused, not rewritten
    assert _cached(token_cache) - before == written
    (tmp_path / "b.txt").write_text("changed\n" * 40)  # new size and mtime: a new entry
    changed = data.Corpus.from_files([str(tmp_path / "*.txt")])
    assert changed.metadata["token_file"] != corpus.metadata["token_file"]
    assert changed.metadata["bytes"] == 600 + 320 and changed.tokens[600:608].tobytes() == b"changed\n"


def test_a_bpe_corpus_holds_each_documents_encoding_in_uint16():
    from diloco_eqx.training.tokenizer import train_bpe

    docs = [(f"d{i}", (f"value_{i} = compute({i}, x)\n" * (20 + i)).encode()) for i in range(6)]
    tok = train_bpe([d for _, d in docs], 290)
    corpus = data.Corpus.from_source(
        sources.Documents("six", tuple(n for n, _ in docs), lambda i: docs[i][1], ["six", 1]), tok)
    assert corpus.tokens.dtype == np.uint16 and corpus.vocab_size == tok.vocab_size > 256  # merges ran out
    for i, (_, text) in enumerate(docs):
        np.testing.assert_array_equal(corpus.tokens[corpus.offsets[i] : corpus.offsets[i + 1]], tok.encode(text))
    assert corpus.metadata["bytes"] == sum(len(d) for _, d in docs) > 2 * corpus.metadata["tokens"]
    # unigram entropy of the ids, against a direct count
    counts = np.bincount(np.asarray(corpus.tokens), minlength=tok.vocab_size)
    p = counts[counts > 0] / counts.sum()
    assert corpus.unigram_entropy() == pytest.approx(-(p * np.log(p)).sum(), rel=1e-12)


def write_llmc(path, ids, version):
    """A token file as llm.c writes one: 256 int32 (magic, version, count), then the ids."""
    header = np.zeros(256, np.int32)
    header[:3] = [20240520, version, len(ids)]
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(np.asarray(ids, np.uint16 if version == 1 else np.uint32).tobytes())


def test_nanogpt_and_llmc_token_files(tmp_path):
    ids = (np.arange(3 * token_files.RAW_DOC_TOKENS + 100) * 7919 % 50257).astype(np.uint16)
    ids.tofile(tmp_path / "train.bin")  # nanoGPT: raw uint16, no header
    corpus = data.Corpus.from_token_file(tmp_path / "train.bin")
    assert isinstance(corpus.tokens, np.memmap) and corpus.tokens.dtype == np.uint16
    np.testing.assert_array_equal(corpus.tokens, ids)
    assert corpus.doc_names == ("train.bin#0", "train.bin#1", "train.bin#2", "train.bin#3")
    assert corpus.doc_sizes().tolist() == [token_files.RAW_DOC_TOKENS] * 3 + [100]
    assert corpus.vocab_size == int(ids.max()) + 1 and corpus.tokenizer.token_bytes is None
    assert np.array_equal(corpus.split()[1], sources.split_names(corpus.doc_names)[1])
    for version, big in ((1, 60000), (2, 1 << 20)):
        llmc = np.array([5, big, 0, 7] * 50)
        write_llmc(tmp_path / f"v{version}.bin", llmc, version)
        c = data.Corpus.from_token_file(tmp_path / f"v{version}.bin")
        assert c.tokens.dtype == (np.uint16 if version == 1 else np.uint32)
        np.testing.assert_array_equal(c.tokens, llmc)
        assert c.vocab_size == big + 1


def test_token_file_errors(tmp_path):
    (tmp_path / "odd.bin").write_bytes(b"\x01\x02\x03")
    (tmp_path / "empty.bin").write_bytes(b"")
    write_llmc(tmp_path / "v3.bin", [1, 2, 3], 1)
    raw = (tmp_path / "v3.bin").read_bytes()
    (tmp_path / "v3.bin").write_bytes(raw[:4] + np.int32(3).tobytes() + raw[8:])
    (tmp_path / "short.bin").write_bytes(raw[:-2])  # header says 3 ids, 2 follow
    for name, match in (("odd", "3 bytes is not 0 header bytes"), ("empty", "corrupt or empty"),
                        ("v3", "corrupt llm.c header: version 3"), ("short", "is not 1024 header bytes")):
        with pytest.raises(ValueError, match=f"--corpus .*{name}.bin: .*{match}"):
            token_files.read_token_file(tmp_path / f"{name}.bin")
    np.array([1, 2, 300], np.uint16).tofile(tmp_path / "ids.bin")
    tf = token_files.read_token_file(tmp_path / "ids.bin")
    BYTES.save(tmp_path / "bytes.json")
    with pytest.raises(ValueError, match=r"--corpus .*ids.bin holds token id 300, beyond the 256 ids"):
        token_files.token_file_tokenizer(tf, str(tmp_path / "bytes.json"))
    with pytest.raises(ValueError, match=r"--tokenizer bpe:300 trains a tokenizer on text, but --corpus"):
        token_files.token_file_tokenizer(tf, "bpe:300")
    with pytest.raises(ValueError, match=r"--corpus .*: give exactly one token file"):
        sources.token_file([str(tmp_path / "*.bin")])
    with pytest.raises(ValueError, match=r"--corpus path '.*missing.array_record' matches no file"):
        sources.documents([str(tmp_path / "missing.array_record")])
    (tmp_path / "bad.array_record").write_bytes(b"x" * 100)
    with pytest.raises(ValueError, match=r"--corpus .*bad.array_record: not a readable ArrayRecord"):
        sources.documents([str(tmp_path / "bad.array_record")])
    with pytest.raises(ValueError, match=r"--corpus markov takes integer key=value options"):
        sources.documents(["markov", "branching=two"])


def test_array_record_corpus(tmp_path):
    from array_record.python.array_record_module import ArrayRecordWriter

    texts = {}
    for f in ("a", "b"):
        writer = ArrayRecordWriter(str(tmp_path / f"{f}.array_record"), "group_size:1")
        for j in range(30):
            texts[f"{f}.array_record#{j}"] = f"record {j} of {f}: {'é' * j}\n".encode() * 5
            writer.write(texts[f"{f}.array_record#{j}"])
        writer.close()
    docs = sources.documents([str(tmp_path / "*.array_record")])
    corpus = data.Corpus.from_source(docs)
    assert corpus.doc_names == tuple(texts) and isinstance(corpus.tokens, np.memmap)
    for i, text in enumerate(texts.values()):
        assert corpus.tokens[corpus.offsets[i] : corpus.offsets[i + 1]].tobytes() == text
    train, held = corpus.split(0.2)
    assert np.array_equal(held, sources.split_names(list(texts), 0.2)[1]) and 0 < len(held) < 30


MEMORY_PROBE = """
import json, sys, numpy as np
from diloco_eqx.training import data

def status(key):
    return int(next(l for l in open("/proc/self/status") if l.startswith(key)).split()[1]) * 1024

open("/proc/self/clear_refs", "w").write("5")  # peak RSS := current RSS
base = status("VmRSS")
corpus = data.Corpus.from_token_file(sys.argv[1])
train, held = corpus.split()
ds = data.train_batches(corpus, train, seq_len=256, global_batch=16, num_islands=2, seed=0, rows=(0, 8))
it = iter(ds.to_iter_dataset())
rows = [next(it) for _ in range(25)] + data.eval_batches(corpus, held, seq_len=256, batch_size=16, max_batches=4)
entropy = corpus.unigram_entropy(held)
# each row is a contiguous run of the file's ids (i % 65521 at position i)
ok = all(np.all((np.diff(r.astype(np.int64), axis=1) % 65521) == 1) for r in rows)
print(json.dumps({"peak_growth": status("VmHWM") - base, "vocab": corpus.vocab_size, "rows_ok": ok,
                  "documents": corpus.num_docs, "held": len(held), "entropy": entropy}))
"""


def test_a_64mb_token_file_is_read_without_loading_it(tmp_path):
    """A subprocess opens a 64 MiB nanoGPT-style file, builds the batches, draws 25 training
    and 4 held-out batches: its peak RSS grows by a small fraction of the file."""
    import json
    import subprocess

    from tests.helpers import subprocess_env

    path, n = tmp_path / "big.bin", 32 << 20
    with open(path, "wb") as f:
        for s in range(0, n, 1 << 22):
            f.write((np.arange(s, s + (1 << 22), dtype=np.int64) % 65521).astype(np.uint16).tobytes())
    assert path.stat().st_size == 64 << 20
    out = subprocess.run([sys.executable, "-c", MEMORY_PROBE, str(path)], env=subprocess_env(),
                         capture_output=True, text=True, timeout=120, check=True)
    got = json.loads(out.stdout.splitlines()[-1])
    print(f"peak RSS growth {got['peak_growth'] / 2**20:.1f} MiB for a 64 MiB token file")
    assert got["vocab"] == 65521 and got["rows_ok"] and got["documents"] == 512 and got["held"] > 0
    assert got["entropy"] == pytest.approx(math.log(65521), abs=0.01)  # ids ~ uniform over 0..65520
    assert got["peak_growth"] < 12 << 20
