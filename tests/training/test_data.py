"""Data: tokenizer, corpora, the held-out split, windows, island shards, iterator state."""

import math
import sys

import numpy as np
import pytest

from diloco_eqx.training import data


def test_byte_tokenizer_round_trip():
    text = "def f(x):\n    return x ** 2  # café ✓\n"
    tokens = data.encode(text)
    assert tokens.dtype == np.uint8 and len(tokens) == len(text.encode())
    assert data.decode(tokens) == text


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
    with pytest.raises(ValueError, match=r"seq_len=63 leaves 0 windows of 64 tokens .*longest document: 50 bytes"):
        data.train_batches(corpus, np.arange(4), seq_len=63, global_batch=2, num_islands=2, seed=0)
    with pytest.raises(ValueError, match=r"global batch size \(GBS\)=3 must be divisible by num_replicas \(K\)=2"):
        data.train_batches(corpus, np.arange(4), seq_len=7, global_batch=3, num_islands=2, seed=0)
    with pytest.raises(ValueError, match="no held-out document is longer than 64 bytes"):
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
