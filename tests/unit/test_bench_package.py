"""The benchmarks package: its modules import one another one way (no circle), the scripts/ entries
are thin wrappers that import no other script, the package stays out of the angelgpt wheel, and its
one result-file writer names a run again NAME-runN.json and never overwrites a file."""

import ast
import json
import subprocess
import sys
import tomllib

import pytest

from benchmarks.results import stamp, write_result
from tests.helpers import ROOT

PACKAGE = ROOT / "benchmarks"


def imports(path) -> set:
    """The modules a file imports, at its top or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
    return found


def package_graph() -> dict:
    """{module: the package's modules it imports}, for every module of benchmarks/."""
    modules = {f"benchmarks.{p.stem}" for p in PACKAGE.glob("*.py") if p.stem != "__init__"}
    return {f"benchmarks.{p.stem}": sorted(imports(p) & modules - {f"benchmarks.{p.stem}"})
            for p in PACKAGE.glob("*.py") if p.stem != "__init__"}


def circle(graph: dict):
    """A list of modules that import one another in a circle, or None."""
    state = {}

    def visit(node, path):
        state[node] = "open"
        for nxt in graph.get(node, []):
            if state.get(nxt) == "open":
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt, path + [nxt])):
                return found
        state[node] = "done"
        return None

    for node in graph:
        if node not in state and (found := visit(node, [node])):
            return found
    return None


def test_the_package_imports_one_way():
    graph = package_graph()
    assert {"benchmarks.results", "benchmarks.report", "benchmarks.peers", "benchmarks.figures"} <= set(graph)
    assert circle(graph) is None
    assert graph["benchmarks.results"] == [] and graph["benchmarks.systems"] == []
    assert "benchmarks.peers" not in graph["benchmarks.report"]  # the report reads benchmarks.systems
    # the check itself finds a circle
    assert circle({"a": ["b"], "b": ["c"], "c": ["a"]}) == ["a", "b", "c", "a"]


def test_scripts_import_no_other_script_and_the_package_no_script():
    for path in [*ROOT.glob("scripts/*.py"), *PACKAGE.glob("*.py")]:
        assert not {m for m in imports(path) if m == "scripts" or m.startswith("scripts.")}, path


def test_the_package_is_not_in_the_wheel():
    """pyproject lists the wheel's packages, or has setuptools find them: either way angelgpt's only."""
    from setuptools import find_packages

    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    if isinstance(packages, dict):
        find = packages["find"]
        packages = find_packages(str(ROOT), include=find["include"], exclude=find.get("exclude", ()))
    assert "angelgpt" in packages and not [p for p in packages if p.split(".")[0] != "angelgpt"], packages


def test_a_result_file_is_never_overwritten(tmp_path, monkeypatch):
    monkeypatch.setenv("ANGELGPT_COMMIT", "0123abc")
    monkeypatch.setenv("ANGELGPT_BENCH_CALL", "call-1")
    paths = []
    for n in range(3):
        result = stamp("case", "python scripts/bench_x.py --n 1")
        result["n"] = n
        paths.append(write_result(tmp_path / "out", result))
    assert [p.name for p in paths] == ["case.json", "case-run2.json", "case-run3.json"]
    first = json.loads(paths[0].read_text())
    assert first["n"] == 0 and first["command"] == "python scripts/bench_x.py --n 1"
    assert first["commit"] == "0123abc" and first["call"] == "call-1" and first["machine"]["host"]
    with pytest.raises(ValueError, match="commit, machine"):
        write_result(tmp_path / "out", {"name": "case", "command": "x"})
    assert len(list((tmp_path / "out").iterdir())) == 3


@pytest.mark.subprocess
def test_the_commands_keep_working(tmp_path):
    (tmp_path / "case.json").write_text("{}")
    for cmd in (["scripts/bench_train.py", "--help"], ["scripts/bench_peers.py", "report", "--help"],
                ["-m", "benchmarks.report", "--help"], ["-m", "benchmarks.results", "path", str(tmp_path), "case"]):
        proc = subprocess.run([sys.executable, *cmd], cwd=ROOT, text=True, capture_output=True, timeout=120)
        assert proc.returncode == 0, (cmd, proc.stderr)
    assert proc.stdout.strip() == str(tmp_path / "case-run2.json")
