"""Tokenizer training and `data prepare` on the shared corpus, read back through Megatron's IndexedDataset."""

import json
import os

import numpy as np
import pytest

from tests.helpers import CORPUS, check_one_line_error, run_cli, run_cli_in_process, train_tiny


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory, request):
    corpus = request.getfixturevalue("corpus")
    out = tmp_path_factory.mktemp("tok")
    from angelgpt.data.tokenizer import train_tokenizer

    train_tokenizer([str(corpus)], str(out), vocab_size=1024)
    return out


@pytest.fixture(scope="module")
def corpus():
    if not CORPUS.is_file():
        pytest.skip(f"{CORPUS} not present")
    return CORPUS


def documents(corpus):
    return [d for d in corpus.read_text().split("\n\n") if d.strip()]


def test_tokenizer_round_trips_corpus_exactly(tokenizer, corpus):
    from angelgpt.data.tokenizer import load_tokenizer

    settings = json.loads((tokenizer / "tokenizer.json").read_text())
    assert settings["byte_fallback"] and settings["split_digits"] and settings["normalization_rule_name"] == "identity"
    tok = load_tokenizer(str(tokenizer))
    text = corpus.read_text()
    ids = tok.tokenize(text)
    assert tok.detokenize(ids) == text
    odd = "tabs\tand  spaces\n\n12345 ünïcödé 🙂 \r"
    assert tok.detokenize(tok.tokenize(odd)) == odd  # byte fallback for unseen characters


@pytest.mark.slow  # tokenizes the corpus three times
def test_prepare_txt_jsonl_parquet_agree_and_read_back(tokenizer, corpus, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from angelgpt.data.prepare import prepare
    from angelgpt.data.tokenizer import load_tokenizer

    docs = documents(corpus)
    jsonl = tmp_path / "c.jsonl"
    jsonl.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    parquet = tmp_path / "c.parquet"
    pq.write_table(pa.table({"text": docs}), parquet)
    counts = {}
    for name, path in (("txt", corpus), ("jsonl", jsonl), ("parquet", parquet)):
        summary = prepare(str(path), str(tokenizer), str(tmp_path / name), workers=2, append_eod=True, progress=False)
        counts[name] = (summary.documents, summary.tokens)
    assert counts["txt"] == counts["jsonl"] == counts["parquet"]

    tok = load_tokenizer(str(tokenizer))
    ds = IndexedDataset(str(tmp_path / "jsonl") + "_text_document")
    assert len(ds) == len(docs)
    assert ds.index.dtype == np.uint16  # smallest dtype that holds a 1024 vocabulary
    for i in (0, 1, len(docs) // 2, len(docs) - 1):
        assert ds[i].tolist() == tok.tokenize(docs[i]) + [tok.eod]
    total = sum(len(tok.tokenize(d)) + 1 for d in docs)
    assert counts["txt"] == (len(docs), total)


@pytest.mark.subprocess
def test_non_utf8_bytes_are_replaced_and_counted(tokenizer, tmp_path):
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"good text\n\nbad \xff\xfe bytes\n")
    proc = run_cli("data", "prepare", "--input", bad, "--tokenizer", tokenizer, "--output", tmp_path / "out")
    assert proc.returncode == 0, proc.stderr
    assert "2 non-UTF-8 bytes replaced" in proc.stdout
    assert (tmp_path / "out_text_document.bin").is_file() and (tmp_path / "out_text_document.idx").is_file()


def bad_prepare_cases(tokenizer, tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n\n")
    nokey = tmp_path / "nokey.jsonl"
    nokey.write_text('{"body": "hello"}\n')
    ok = tmp_path / "ok.txt"
    ok.write_text("hello world\n")
    return {
        "missing file": (["--input", tmp_path / "nope.txt", "--tokenizer", tokenizer], "no such file"),
        "empty corpus": (["--input", empty, "--tokenizer", tokenizer], "holds no non-empty documents"),
        "missing text key": (["--input", nokey, "--tokenizer", tokenizer], "column 'text' not in the data"),
        "tokenizer missing": (["--input", ok, "--tokenizer", tmp_path / "no-tok"], "tokenizer not found"),
        "offline dataset name": (["--input", "some-org/some-corpus", "--tokenizer", tokenizer],
                                 "give a local .jsonl/.json/.txt/.parquet/.csv path"),
    }


@pytest.mark.subprocess
def test_prepare_bad_input_in_its_own_process(tokenizer, tmp_path):
    """The answer as a shell sees it (the process's exit code and its stderr), to a dataset name, which
    HF_HUB_OFFLINE in the process's environment keeps off the network."""
    args, needle = bad_prepare_cases(tokenizer, tmp_path)["offline dataset name"]
    proc = run_cli("data", "prepare", *args, "--output", tmp_path / "out", env={"HF_HUB_OFFLINE": "1"})
    check_one_line_error(proc, needle)
    assert not [p for p in os.listdir(tmp_path) if p.startswith("out")]  # nothing half-written


@pytest.mark.parametrize("case", ["missing file", "empty corpus", "missing text key", "tokenizer missing"])
def test_prepare_bad_input(case, tokenizer, tmp_path):
    args, needle = bad_prepare_cases(tokenizer, tmp_path)[case]
    proc = run_cli_in_process("data", "prepare", *args, "--output", tmp_path / "out")
    check_one_line_error(proc, needle)
    assert not [p for p in os.listdir(tmp_path) if p.startswith("out")]  # nothing half-written


@pytest.mark.subprocess
def test_tokenizer_train_bad_input(tmp_path):
    check_one_line_error(run_cli("tokenizer", "train", "--input", tmp_path / "nope.txt", "--output", tmp_path / "t"),
                         "no such file")
    (tmp_path / "a.txt").write_text("abc\n")
    check_one_line_error(run_cli("tokenizer", "train", "--input", tmp_path / "a.txt", "--output", tmp_path / "t",
                                 "--model-type", "wordpiece"), "--model-type must be 'bpe' or 'unigram'")


def test_a_vocabulary_smaller_than_the_tokenizers_is_refused_before_launch(tokenizer, corpus, tmp_path):
    """model.vocab_size below the tokenizer's 1024 pieces: refused by the launcher in one line (in a dry
    run too), before any worker starts."""
    from angelgpt.data.prepare import prepare

    data = prepare(str(corpus), str(tokenizer), str(tmp_path / "shk"), append_eod=True, progress=False)
    proc = run_cli_in_process("train", "--size", "tiny", "--device", "cpu", "--dry-run", f"data.paths={data.prefix}",
                              f"data.tokenizer={tokenizer}", "model.vocab_size=512")
    check_one_line_error(proc, "tokenizer has 1024 tokens but model.vocab_size is 512")


@pytest.mark.subprocess
def test_a_split_that_leaves_the_validation_split_no_document_is_refused_before_launch(tokenizer, corpus, tmp_path):
    """Three documents and data.split 949,50,1 leave validation and test no sequence (Megatron's builder
    would look for their samples forever): with evaluations asked for, refused by the launcher in one
    line before any worker starts; without, the empty splits are left out and training runs."""
    from angelgpt.data.dataset import split_sequences
    from angelgpt.data.prepare import prepare

    three = tmp_path / "three.txt"
    three.write_text("\n\n".join(documents(corpus)[:3]) + "\n")
    data = prepare(str(three), str(tokenizer), str(tmp_path / "three"), append_eod=True, progress=False)
    assert split_sequences("949,50,1", 3) == [3, 0, 0] and split_sequences("949,50,1", 3000) == [2847, 150, 3]
    assert split_sequences("90,10,0", 400) == [360, 40, None]
    args = [f"data.paths={data.prefix}", f"data.tokenizer={tokenizer}", "model.vocab_size=1024"]
    proc = run_cli_in_process("train", "--size", "tiny", "--device", "cpu", "--dry-run", *args, "train.eval_interval=5")
    check_one_line_error(proc, "data.split 949,50,1 gives the validation split none of the 3 sequences")
    metrics = train_tiny(tmp_path, "small", *args, "train.train_iters=2", "model.seq_length=64")
    assert [r["iteration"] for r in metrics] == [1, 2]
