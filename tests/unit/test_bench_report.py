"""BENCHMARKS.md stays true to the result files: `scripts/bench_peers.py report` (benchmarks.report,
filling benchmarks/BENCHMARKS.md.template) run on the committed files into a temporary directory gives
the committed BENCHMARKS.md; every number of its notes is in the result file named beside it; a note
whose file is missing is left out, and said so; a goal ratio of two files from different device calls
is not given as a goal result. The headline (each system's largest size and peers.png) comes before the
goals and the runs; every run says its measured steps (its records after warm-up); a headline figure
resting on fewer than 3 measured steps says so beside it, with no verdict."""

import itertools
import json
import re
import shutil
import statistics

import pytest

from benchmarks.report import generate, report, same_call
from tests.helpers import ROOT

RESULTS = ROOT / "benchmarks" / "results"
# a number outside a word: not the 3 of ZeRO-3, the 2 of H2D or the digits of a commit such as 4e6d409
NUMBER = re.compile(r"(?<![\w.])(?<![A-Za-z]-)\d+(?:\.\d+)?(?!\w|\.\d)")


def figures(notes: str):
    """(number as written, the result file named after it) for every number of every note outside
    code spans; a number with no file after it in its note comes with None."""
    out = []
    for note in (line for line in notes.splitlines() if line.startswith("- ")):
        pending = []
        for part in re.split(r"(`[^`]*`)", note):
            if part.startswith("`"):
                if part.endswith(".json`"):
                    out += [(n, part.strip("`")) for n in pending]
                    pending = []
                continue
            pending += NUMBER.findall(part)
        out += [(n, None) for n in pending]
    return out


def values(result: dict):
    """Every number a result file holds: its numeric fields, the numbers in its text fields (the
    command, the log, what the run settled) and the medians after warm-up of ZeRO-Cache's profile."""
    def walk(x):
        if isinstance(x, dict):
            for v in x.values():
                yield from walk(v)
        elif isinstance(x, list):
            for v in x:
                yield from walk(v)
        elif isinstance(x, str):
            yield from (float(t) for t in re.findall(r"\d+(?:\.\d+)?", x))
        elif isinstance(x, (int, float)) and not isinstance(x, bool):
            yield float(x)

    yield from walk(result)
    steady = [r["zero_cache_profile"] for r in result.get("records", [])[result.get("warmup_iters", 0):]
              if r.get("zero_cache_profile")]
    for key in steady[0] if steady else ():
        yield statistics.median(p[key] for p in steady)


def appears(number: str, result: dict) -> bool:
    places = len(number.split(".")[1]) if "." in number else 0
    return any(f"{v:.{places}f}" == number for v in values(result))


def unsupported(notes: str, results):
    return [(n, f) for n, f in figures(notes)
            if f is None or not (results / f).is_file() or not appears(n, json.loads((results / f).read_text()))]


@pytest.fixture(scope="module")
def committed(tmp_path_factory):
    out = tmp_path_factory.mktemp("report")
    assert report(RESULTS, out, with_chart=False) == 0
    return (out / "BENCHMARKS.md").read_text()


def test_the_committed_benchmarks_md_is_what_report_generates(committed):
    assert (ROOT / "BENCHMARKS.md").read_text() == committed, \
        "BENCHMARKS.md differs from the result files: run python scripts/bench_peers.py report"


def test_every_number_in_the_notes_is_in_the_result_file_named_beside_it(committed):
    notes = committed.split("\n## Notes\n", 1)[1]
    checked = figures(notes)
    assert len(checked) > 100 and len({f for _, f in checked}) > 30  # the notes carry the figures
    assert unsupported(notes, RESULTS) == []
    # the check itself: a figure the file named beside it does not hold is caught
    number, file = next((n, f) for n, f in checked if "." in n and notes.count(n) == 1)
    r = json.loads((RESULTS / file).read_text())
    typed = next(t for t in (f"{float(number) + k / 10:.1f}" for k in range(1, 100)) if not appears(t, r))
    assert unsupported(notes.replace(number, typed), RESULTS) == [(typed, file)]
    assert unsupported("- (d) made 529.6 TFLOP/s at rate 0.75", RESULTS) == [("529.6", None), ("0.75", None)]


@pytest.mark.slow  # generates the report
def test_a_note_whose_file_is_missing_is_left_out_and_said_so(tmp_path, capsys, committed):
    results = tmp_path / "results"
    shutil.copytree(RESULTS, results)
    (results / "peers-zero_cache_nvme-L24-mb2-gb2.json").unlink()  # the NVMe note's one file
    text, _ = generate(results)
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [
        "bench_report: note 'nvme' left out: no peers-zero_cache_nvme-L24-mb2-gb2"], err
    assert [n for n in note_lines(committed) if not n.startswith("- (e) ZeRO-Cache with the NVMe tier")] == \
        note_lines(text)


def note_lines(text: str) -> list:
    return [line for line in text.split("\n## Notes\n", 1)[1].splitlines() if line.startswith("- ")]


def rerun(results, case, call, boot_id="boot-1"):
    """A run again of a committed case as scripts/bench_train.py writes it: NAME-run2.json, with the
    device call and the machine recorded (no call: as files written before runs recorded it)."""
    r = json.loads((RESULTS / f"{case}.json").read_text())
    r.update(date="2099-01-01T00:00:00Z")
    if call:
        r.update(call=call, machine=dict(r["machine"], boot_id=boot_id))
    (results / f"{case}-run2.json").write_text(json.dumps(r))


A7, D7 = "peers-megatron-L7-mb2-gb32-recomputenone", "peers-zero_cache-L7-mb2-gb32-recomputenone"


@pytest.mark.slow  # generates the report
def test_a_ratio_of_two_files_from_different_calls_is_not_a_goal_result(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    for case in (A7, D7):
        shutil.copy(RESULTS / f"{case}.json", results)

    def at_a7():
        text, _ = generate(results)
        return text, next(line for line in text.splitlines()
                          if line.startswith("| speed: (d) / (a) at (a)'s largest measured size (7 layers) |"))

    rerun(results, A7, None)
    rerun(results, D7, None)
    text, line = at_a7()
    assert line.endswith(f"| not a goal result | `{D7}-run2.json` / `{A7}-run2.json` | call unknown |"), line
    for case in (A7, D7):  # the earlier run of each case is listed beside its newest
        assert f"| unknown | `{case}.json` | `{case}-run2.json` |" in text

    rerun(results, A7, "call-1")
    rerun(results, D7, "call-2")
    _, line = at_a7()
    assert line.endswith(f"| not a goal result | `{D7}-run2.json` / `{A7}-run2.json` | different calls |"), line

    rerun(results, D7, "call-1")
    _, line = at_a7()
    assert line.endswith(f"| 1.05x | met | `{D7}-run2.json` / `{A7}-run2.json` | same call |"), line


def test_one_call_on_two_machines_is_not_the_same_call():
    a = {"call": "c", "machine": {"host": "vm", "boot_id": "1", "gpu": "NVIDIA H200"}}
    assert same_call(a, dict(a)) == "same call"
    assert same_call(a, dict(a, machine=dict(a["machine"], boot_id="2"))) == "different calls"
    assert same_call(a, dict(a, call="d")) == "different calls"
    assert same_call(a, {"machine": a["machine"]}) == "call unknown"


def test_a_newer_run_short_of_3_steps_leaves_the_goals_to_the_complete_run(tmp_path):
    """A case run again for fewer than 3 steps is listed as the newest run, but the sizes and goals keep
    the case's newest run that completed them (here the same-call pair of run2's), and the next size up
    that ran short says how many steps it made."""
    results = tmp_path / "results"
    results.mkdir()
    for case in (A7, D7):
        shutil.copy(RESULTS / f"{case}.json", results)
    rerun(results, A7, "call-1")
    rerun(results, D7, "call-1")
    short = json.loads((results / f"{A7}-run2.json").read_text())
    short.update(date="2099-02-01T00:00:00Z", call="call-2", records=short["records"][:2])
    (results / f"{A7}-run3.json").write_text(json.dumps(short))
    text, _ = generate(results)
    line = next(x for x in text.splitlines() if x.startswith("| speed: (d) / (a) at (a)'s largest measured size"))
    assert line.endswith(f"| met | `{D7}-run2.json` / `{A7}-run2.json` | same call |"), line
    assert f"| call-2 | `{A7}-run3.json` |" in text  # the newest run, in the runs table


@pytest.mark.slow  # generates the report
def test_a_case_that_changes_the_shape_counts_its_own_parameters():
    """The 28 preset's shape (128 heads of 128 where the 55's has 64) at 26 layers: 28.35B, not the
    55-shape count of 26 layers."""
    text, _ = generate(RESULTS)
    runs = text.split("\n## Runs\n", 1)[1]
    line = next(x for x in runs.splitlines() if "`peers-zero_cache-L26-mb2-gb8-heads128-" in x)
    assert line.split(" | ")[2] == "28.35B", line


FLAG = "2 measured steps: below 3, not a headline figure"


def steady(result: dict) -> list:
    """The records a result file's medians are taken over: those after `warmup_iters`."""
    return [x for x in result.get("records", []) if x["iteration"] > result.get("warmup_iters", 0)]


def measured(result: dict) -> int:
    return len(steady(result))


def cells(line: str) -> list:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def table(text: str, heading: str) -> list:
    """The rows of the first table under `heading`, as {column: cell}."""
    after = text.split(f"\n{heading}\n", 1)[1].splitlines()
    start = next(i for i, x in enumerate(after) if x.startswith("|"))
    lines = list(itertools.takewhile(lambda x: x.startswith("|"), after[start:]))
    return [dict(zip(cells(lines[0]), cells(x))) for x in lines[2:]]


def test_the_headline_comes_before_the_goals_and_the_runs(committed):
    at = [committed.index(x) for x in ("\n## Largest model that completes 3 optimizer steps\n",
                                        "](benchmarks/peers.png)\n", "\n## Goals\n", "\n## Runs\n",
                                        "\n## The Llama family", "\n## Notes\n")]
    assert at == sorted(at), at
    assert not re.search(r"^\|", committed.split("\n## Largest model", 1)[0], re.M)  # no table before it


def test_every_run_says_its_measured_steps(committed):
    """The runs tables' measured steps are each file's records after warm-up, the steps its median
    TFLOP/s is taken over, and the warm-up steps it ran beside them."""
    rows = table(committed, "## Runs") + table(committed, "### Earlier runs of a case")
    assert len(rows) > 60
    warmed = 0
    for row in rows:
        r = json.loads((RESULTS / row["result file"].strip("`")).read_text())
        n, cell = measured(r), row["measured steps (+ warm-up)"]
        assert int(cell.split()[0]) == n, (row["result file"], cell)
        if len(r["records"]) > n:
            assert f"(+{len(r['records']) - n} warm-up)" in cell, (row["result file"], cell)
            warmed += 1
        if n:
            median = statistics.median(x["tflops_per_gpu"] for x in steady(r))
            assert median == pytest.approx(r["tflops_per_gpu_median"]), row["result file"]
    assert warmed > 40
    run2 = next(x for x in rows if x["result file"].startswith("`peers-zero_cache-L7-mb2-gb32-recomputenone-run2."))
    assert run2["measured steps (+ warm-up)"] == "2 (+2 warm-up)"


def test_a_headline_figure_on_fewer_than_3_measured_steps_is_flagged(tmp_path):
    """A largest size or a goal ratio whose run has 2 measured steps says so beside the figure, gets no
    verdict and stays out of peers.png's speeds; with 3 measured steps the same runs are headline figures."""
    results = tmp_path / "results"
    results.mkdir()
    for case in (A7, D7):
        shutil.copy(RESULTS / f"{case}.json", results)

    def with_steps(n):
        for case in (A7, D7):
            rerun(results, case, "call-1")
            r = json.loads((results / f"{case}-run2.json").read_text())
            r["records"] = r["records"][:r["warmup_iters"] + n]
            r["tflops_per_gpu_median"] = statistics.median(x["tflops_per_gpu"] for x in steady(r))
            assert measured(r) == n
            (results / f"{case}-run2.json").write_text(json.dumps(r))
        text, (_, at, _) = generate(results)
        head = text.split("\n## Runs\n", 1)[0]
        size = next(x for x in table(text, "## Largest model that completes 3 optimizer steps")
                    if x["system"] == "(a) Megatron distributed optimizer")
        goals = [x for x in table(text, "## Goals") if x["measured"] != "not measured"]
        speed = next(x for x in goals if x["goal"].startswith("speed: (d) / (a) at (a)'s largest"))
        return head, size, speed, at, goals

    head, size, speed, at, goals = with_steps(2)
    assert size["measured steps"] == FLAG and size["result file"] == f"`{A7}-run2.json`", size
    assert speed["measured steps"] == "2 / 2" and speed["measured"].endswith(f"x ({FLAG})"), speed
    assert speed[""] == "not a goal result" and speed["device call"] == "same call", speed
    assert len(goals) >= 3 and all(g["measured"].endswith(f"x ({FLAG})") and g[""] == "not a goal result"
                                   for g in goals), goals
    assert at[("megatron", 7)] == 0 and at[("zero_cache", 7)] == 0

    head, size, speed, at, goals = with_steps(3)
    assert size["measured steps"] == "3" and speed["measured steps"] == "3 / 3", (size, speed)
    assert all(g[""] in ("met", "missed") for g in goals) and "below 3" not in head, goals
    assert at[("megatron", 7)] > 0 and at[("zero_cache", 7)] > 0


def test_the_llama_section_stands_without_its_runs_or_a_profile(tmp_path, committed):
    """BENCHMARKS.md's Llama section says "not measured" while no llama-* file exists, also where no
    run has ZeRO-Cache's time profile; a Llama-3-8B run of 2 measured steps is not a goal result."""
    def llama(text):
        return text.split("\n## The Llama family", 1)[1].split("\n## ", 1)[0]

    eight_b = "| (a) Megatron distributed optimizer trains Llama-3-8B (32 layers) | trains |"
    results = tmp_path / "results"
    results.mkdir()
    shutil.copy(RESULTS / f"{A7}.json", results)
    text, _ = generate(results)
    assert "## ZeRO-Cache time profile" not in text
    for part in (llama(committed), llama(text)):
        assert f"{eight_b} not measured |" in part and "| not measured yet |" in part

    r = json.loads((RESULTS / f"{A7}.json").read_text())
    r.update(name="llama-megatron-L32-mb1-gb32", records=r["records"][:r["warmup_iters"] + 2])
    (results / "llama-megatron-L32-mb1-gb32.json").write_text(json.dumps(r))
    part = llama(generate(results)[0])
    assert f"{eight_b} {FLAG} | not a goal result | `llama-megatron-L32-mb1-gb32.json` |" in part, part
