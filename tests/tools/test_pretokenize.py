"""tools/pretokenize: text -> a token file (+ sidecar, + tokenizer) that --corpus FILE.bin reads
back as the same documents, ids and tokenizer."""

import json
from pathlib import Path

import numpy as np
import pytest

from diloco_eqx.training import sources, runner
from diloco_eqx.training import tokenizer as T
from tools import pretokenize

SOURCE = Path(json.__file__).with_name("decoder.py").read_text()


@pytest.fixture
def texts(tmp_path, monkeypatch):
    monkeypatch.setenv("DILOCO_EQX_CACHE", str(tmp_path / "cache"))
    (tmp_path / "in").mkdir()
    for i in range(12):
        (tmp_path / "in" / f"part{i:02d}.py").write_text(SOURCE[i * 900 : i * 900 + 3000] + "# ✓ é\n")
    return sorted((tmp_path / "in").iterdir())


def test_a_bpe_token_file_reads_back_as_the_documents_encodings(texts, tmp_path, capsys):
    import tokenizers

    out = tmp_path / "tok" / "train.bin"
    pretokenize.main([str(texts[0].parent), "--tokenizer", "bpe:320", "--out", str(out)])
    printed = capsys.readouterr().out
    assert sorted(p.name for p in out.parent.iterdir()) == ["train.bin", "train.bin.json",
                                                            "train.bin.tokenizer.json"]
    hf = tokenizers.Tokenizer.from_file(str(out.with_name("train.bin.tokenizer.json")))
    expected = [hf.encode(p.read_text()).ids for p in texts]  # Hugging Face's own encoding
    assert hf.get_vocab_size() == 320 and np.fromfile(out, np.uint16).tolist() == sum(expected, [])
    total = sum(len(p.read_bytes()) for p in texts)
    assert f"12 documents, {total:,} bytes -> {sum(map(len, expected)):,} uint16 ids" in printed
    corpus = runner.load_corpus((str(out),))  # the file's own tokenizer, from beside it
    assert corpus.tokenizer.identity == T.load(out.with_name("train.bin.tokenizer.json")).identity
    assert corpus.doc_names == tuple(str(p) for p in texts) and isinstance(corpus.tokens, np.memmap)
    assert corpus.doc_sizes().tolist() == [len(e) for e in expected] and corpus.metadata["bytes"] == total
    assert np.array_equal(corpus.split()[1], sources.split_names([str(p) for p in texts])[1])
    with pytest.raises(ValueError, match=r"--tokenizer bpe:300 trains a tokenizer on text, but --corpus"):
        runner.load_corpus((str(out),), "bpe:300")
    T.train_bpe([b"other text entirely" * 50], 300).save(tmp_path / "other.json")
    with pytest.raises(ValueError, match=r"--corpus .*train.bin was tokenized with bpe:320 .* not with"):
        runner.load_corpus((str(out),), str(tmp_path / "other.json"))


def test_bytes_with_an_llmc_header_and_a_runs_tokenizer(texts, tmp_path):
    out = tmp_path / "bytes.bin"
    pretokenize.main([*map(str, texts), "--out", str(out), "--llmc-header"])
    header = np.fromfile(out, np.int32, count=256)
    raw = b"".join(p.read_bytes() for p in texts)
    assert header[:3].tolist() == [20240520, 1, len(raw)] and not header[3:].any()
    assert np.fromfile(out, np.uint16, offset=1024).tolist() == list(raw)  # uint16, as llm.c reads
    corpus = runner.load_corpus((str(out),))
    assert corpus.tokenizer is T.BYTES and bytes(np.asarray(corpus.tokens, np.uint8)) == raw
    # a run's tokenizer.json: the same ids as that tokenizer gives the text
    run_tok = T.train_bpe([p.read_bytes() for p in texts], 300)
    run_tok.save(tmp_path / "tokenizer.json")
    pretokenize.main([*map(str, texts), "--tokenizer", str(tmp_path / "tokenizer.json"),
                      "--out", str(tmp_path / "run.bin")])
    again = runner.load_corpus((str(tmp_path / "run.bin"),), str(tmp_path / "tokenizer.json"))
    assert again.tokenizer.identity == run_tok.identity
    assert np.array_equal(again.tokens, np.concatenate([run_tok.encode(p.read_bytes()) for p in texts]))


def test_usage_errors(texts, tmp_path, capsys):
    for args, message in (([str(texts[0]), "--out", str(tmp_path / "x.txt")], "a token file's name ends in .bin"),
                          ([str(texts[0]), "--tokenizer", "bpe:100", "--out", str(tmp_path / "x.bin")],
                           "--tokenizer bpe:100: N of bpe:N must be an integer above 256"),
                          ([str(tmp_path / "none*"), "--out", str(tmp_path / "x.bin")], "matches no file")):
        with pytest.raises(SystemExit) as e:
            pretokenize.main(args)
        assert e.value.code == 2 and message in capsys.readouterr().err
    assert not list(tmp_path.glob("x.*"))
