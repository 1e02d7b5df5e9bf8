"""`data prepare --output DIR/PREFIX` creates a missing DIR (an impossible one is one line, exit 2);
progress bars of `data prepare` and `tokenizer train` go to stderr only when it is a terminal or when
ANGELGPT_PROGRESS=1 forces them, so captured output stays clean."""

import os

import pytest

from tests.helpers import CORPUS, check_one_line_error, run_cli

pytestmark = pytest.mark.subprocess  # each test runs the CLI


@pytest.fixture(scope="module")
def small_corpus(tmp_path_factory):
    if not CORPUS.is_file():
        pytest.skip(f"{CORPUS} not present")
    path = tmp_path_factory.mktemp("corpus") / "small.txt"
    path.write_text(CORPUS.read_text()[:60_000])
    return path


@pytest.fixture(scope="module")
def tokenizer(small_corpus, tmp_path_factory):
    from angelgpt.data.tokenizer import train_tokenizer

    out = tmp_path_factory.mktemp("tok")
    train_tokenizer([str(small_corpus)], str(out), vocab_size=512, progress=False)
    return out


def test_prepare_creates_the_missing_output_directory_and_draws_no_bar_into_a_pipe(small_corpus, tokenizer,
                                                                                    tmp_path):
    out = tmp_path / "new" / "deeper" / "corpus"
    proc = run_cli("data", "prepare", "--input", small_corpus, "--tokenizer", tokenizer, "--output", out,
                   env={"ANGELGPT_PROGRESS": ""})
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "new" / "deeper" / "corpus_text_document.bin").is_file()
    assert (tmp_path / "new" / "deeper" / "corpus_text_document.idx").is_file()
    lines = proc.stdout.strip().splitlines()
    assert lines[-1].startswith(f"wrote {out}_text_document.bin/.idx: ") and "tokens/s" in lines[-1]
    assert proc.stderr == ""  # stderr is a pipe here: no bar, no counter


def test_prepare_forced_progress_draws_bars_on_stderr(small_corpus, tokenizer, tmp_path):
    proc = run_cli("data", "prepare", "--input", small_corpus, "--tokenizer", tokenizer, "--output",
                   tmp_path / "c", env={"ANGELGPT_PROGRESS": "1"})
    assert proc.returncode == 0, proc.stderr
    assert "writing: 100%" in proc.stderr and "tokenizing" in proc.stderr
    assert "wrote " in proc.stdout and "writing" not in proc.stdout


def test_prepare_into_a_directory_that_cannot_be_made_is_one_line(small_corpus, tokenizer, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory\n")
    proc = run_cli("data", "prepare", "--input", small_corpus, "--tokenizer", tokenizer, "--output",
                   blocker / "sub" / "corpus")
    check_one_line_error(proc, f"--output: cannot create directory {blocker / 'sub'}: {blocker} is not a directory")
    assert sorted(os.listdir(tmp_path)) == ["file"]


def test_prepare_with_bad_input_creates_no_output_directory(tokenizer, tmp_path):
    proc = run_cli("data", "prepare", "--input", tmp_path / "nope.txt", "--tokenizer", tokenizer, "--output",
                   tmp_path / "new" / "corpus")
    check_one_line_error(proc, "no such file")
    assert not (tmp_path / "new").exists()


def test_tokenizer_training_progress_only_when_forced(small_corpus, tmp_path):
    quiet = run_cli("tokenizer", "train", "--input", small_corpus, "--vocab-size", "512", "--output", tmp_path / "a",
                    env={"ANGELGPT_PROGRESS": ""})
    assert quiet.returncode == 0, quiet.stderr
    assert quiet.stderr == "" and "wrote " in quiet.stdout
    shown = run_cli("tokenizer", "train", "--input", small_corpus, "--vocab-size", "512", "--output", tmp_path / "b",
                    env={"ANGELGPT_PROGRESS": "1"})
    assert shown.returncode == 0, shown.stderr
    assert "reading small.txt: 100%" in shown.stderr and "training SentencePiece (unigram, 512 pieces)" in shown.stderr
    assert (tmp_path / "b" / "tokenizer.model").is_file()
