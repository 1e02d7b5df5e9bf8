"""benchmarks.numerics: the corpus it takes from a standard library, its comparison lines and its plot."""

from benchmarks.numerics import compare, corpus_files, main, svg


def test_the_corpus_is_the_standard_librarys_source_without_installed_packages(tmp_path):
    for rel in ("json/__init__.py", "a.py", "site-packages/x/y.py", "dist-packages/z.py", "notes.txt"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("pass\n")
    assert [p.relative_to(tmp_path).as_posix() for p in corpus_files(tmp_path)] == ["a.py", "json/__init__.py"]


def test_runs_are_compared_with_the_first_and_drawn_one_line_each():
    runs = [{"name": "fp32", "returncode": 0, "val_loss": [[100, 4.0], [200, 3.0]]},
            {"name": "bf16", "returncode": 0, "val_loss": [[100, 4.1], [200, 3.015]]},
            {"name": "broken", "returncode": 1, "val_loss": []}]
    assert compare(runs) == ["fp32: validation loss 3.0000 at iteration 200, +0.00% against fp32",
                             "bf16: validation loss 3.0150 at iteration 200, +0.50% against fp32",
                             "broken: no validation loss (exit 1)"]
    drawing = svg({r["name"]: r["val_loss"] for r in runs}, "t")
    assert drawing.startswith("<svg") and drawing.count("<polyline") == 3 and ">bf16<" in drawing


def test_bad_input_is_one_line_and_exit_2_with_nothing_written(tmp_path, capsys):
    for args, needle in ((["prepare", "--out", str(tmp_path / "p"), "--stdlib", str(tmp_path / "none")], "no Python source"),
                         (["run", "--name", "x", "--data", str(tmp_path / "none"), "--out", str(tmp_path / "r")],
                          "no manifest.json"),
                         (["plot", str(tmp_path / "none.json"), "--out", str(tmp_path / "x.svg")], "no result file")):
        assert main(args) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and needle in err, err
    assert list(tmp_path.iterdir()) == []
