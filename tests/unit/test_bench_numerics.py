"""benchmarks.numerics: the corpus it takes from a standard library, its comparison lines and its plot."""

import pytest

from benchmarks.numerics import compare, corpus_files, main, spread, svg


def test_the_corpus_is_the_standard_librarys_source_without_installed_packages(tmp_path):
    for rel in ("json/__init__.py", "a.py", "site-packages/x/y.py", "dist-packages/z.py", "notes.txt"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("pass\n")
    assert [p.relative_to(tmp_path).as_posix() for p in corpus_files(tmp_path)] == ["a.py", "json/__init__.py"]


def test_runs_are_compared_with_the_first_and_drawn_one_line_each():
    runs = [{"name": "fp32", "returncode": 0, "val_loss": [[100, 4.0], [200, 3.0]]},
            {"name": "bf16", "returncode": 0, "val_loss": [[100, 4.1], [200, 3.015]]},
            {"name": "broken", "returncode": 1, "val_loss": []},
            {"name": "cut", "returncode": "time limit", "val_loss": [[100, 4.2]]}]
    assert compare(runs) == ["fp32: validation loss 3.0000 at iteration 200, +0.00% against fp32",
                             "bf16: validation loss 3.0150 at iteration 200, +0.50% against fp32",
                             "broken: no validation loss (exit 1)",
                             "cut: validation loss 4.2000 at iteration 100, +5.00% against fp32 (stopped: time limit)"]
    drawing = svg({r["name"]: r["val_loss"] for r in runs}, "t")
    assert drawing.startswith("<svg") and drawing.count("<polyline") == 4 and ">bf16<" in drawing


def test_the_spread_groups_runs_by_format_and_compares_each_seed_with_the_first_formats():
    def run(seed, loss, *fmt, returncode=0):
        return {"returncode": returncode, "val_loss": [[100, 9.0], [600, loss]],
                "overrides": ["model.num_layers=4", *([f"train.seed={seed}"] if seed else []), *fmt]}
    fp8 = ("optim.exp_avg_dtype=fp8",)
    lines = spread([run(None, 4.0), run(1235, 4.2), run(1236, 3.8), run(1235, 4.2 * 1.02, *fp8),
                    run(None, 4.0 * 0.99, *fp8), run(1236, 9.9, *fp8, returncode=1)])
    assert lines[0].startswith("| format | seed 1234 | seed 1235 | seed 1236 | seed-to-seed range |")
    assert lines[2] == ("| - | 4.0000 (it 600) | 4.2000 (it 600) | 3.8000 (it 600) | 10.00% | "
                        "+0.00%; +0.00% to +0.00% |")
    assert lines[3] == ("| optim.exp_avg_dtype=fp8 | 3.9600 (it 600) | 4.2840 (it 600) | not run | "
                        "7.86% | +0.50%; -1.00% to +2.00% |")
    assert spread([run(1, 4.0, returncode="time limit")]) == ["no completed run"]


@pytest.mark.subprocess
def test_a_run_past_its_time_limit_is_stopped_with_its_children():
    """_stop ends the run's whole process group (a launcher and the workers it started), not the
    launcher alone."""
    import os
    import subprocess
    import sys
    import time

    from benchmarks.numerics import _stop

    child = "import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); print(p.pid, flush=True); time.sleep(120)"
    proc = subprocess.Popen([sys.executable, "-c", child], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    grandchild = int(proc.stdout.readline())
    t0 = time.monotonic()
    _stop(proc)
    assert proc.poll() is not None and time.monotonic() - t0 < 30
    for _ in range(50):  # reaped by init once it died
        try:
            os.kill(grandchild, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"process {grandchild} outlived the stop")


def test_bad_input_is_one_line_and_exit_2_with_nothing_written(tmp_path, capsys):
    given = tmp_path.parent / f"{tmp_path.name}-given"
    given.mkdir()
    (given / "text.json").write_text("not JSON")
    (given / "list.json").write_text("[1, 2]")
    for args, needle in ((["spread", str(given / "text.json")], "text.json is not a result file"),
                         (["spread", str(given / "list.json")], "list.json is not a result file"),
                         (["plot", str(given / "text.json"), "--out", str(tmp_path / "x.svg")], "is not a result file"),
                         (["prepare", "--out", str(tmp_path / "p"), "--stdlib", str(tmp_path / "none")], "no Python source"),
                         (["run", "--name", "x", "--data", str(tmp_path / "none"), "--out", str(tmp_path / "r")],
                          "no manifest.json"),
                         (["plot", str(tmp_path / "none.json"), "--out", str(tmp_path / "x.svg")], "no result file")):
        assert main(args) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and needle in err, err
    assert list(tmp_path.iterdir()) == []
