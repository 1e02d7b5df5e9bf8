"""The shape angelgpt/ keeps: its modules import one another one way (no circle, counting imports inside
functions), and so do its folders (angelgpt/zero_cache/ never imports the optimizer package whose
front it is), none is over 400 lines but the config schema, no function or method is over 80 lines, and no
rehearsal mode is read from a module global outside the rehearsal module."""

import ast

from tests.helpers import ROOT
from tests.unit.test_bench_package import circle, imports

PACKAGE = ROOT / "angelgpt"


def modules() -> dict:
    """module name -> file, for every module of angelgpt/ (a package by its __init__)."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def import_graph() -> dict:
    """module -> the angelgpt modules it imports."""
    mods = modules()
    graph = {}
    for name, path in mods.items():
        targets = set()
        for imp in imports(path):  # `from a.b import c` names module a.b.c when there is one, else a.b
            while imp and imp not in mods:
                imp = imp.rpartition(".")[0]
            if imp and imp != name and not name.startswith(imp + "."):  # a package's own __init__ is not a circle
                targets.add(imp)
        graph[name] = sorted(targets)
    return graph


def test_angelgpt_imports_one_way():
    graph = import_graph()
    assert circle(graph) is None, circle(graph)


def test_angelgpt_folders_import_one_way():
    """angelgpt.X.* importing angelgpt.Y.* and Y's modules importing X's is a circle between folders,
    though no module's imports lead back to it."""
    folder = lambda m: ".".join(m.split(".")[:2])  # noqa: E731
    folders = {}
    for name, targets in import_graph().items():
        folders.setdefault(folder(name), set()).update(folder(t) for t in targets if folder(t) != folder(name))
    graph = {f: sorted(t) for f, t in folders.items()}
    assert circle(graph) is None, circle(graph)


def test_no_module_is_over_400_lines_but_the_schema():
    long = {str(p.relative_to(ROOT)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 400}
    assert long.keys() <= {"angelgpt/config/schema.py"}, long


def long_functions(limit: int = 80) -> dict:
    """'path:Class.function' -> lines (from `def` to its last line, docstring and nested functions included)
    of every function or method of angelgpt/ over `limit` lines."""
    found = {}

    def visit(node, path, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = prefix + child.name
                if not isinstance(child, ast.ClassDef) and (n := child.end_lineno - child.lineno + 1) > limit:
                    found[f"{path}:{name}"] = n
                visit(child, path, name + ".")
            else:
                visit(child, path, prefix)

    for p in sorted(PACKAGE.rglob("*.py")):
        visit(ast.parse(p.read_text()), str(p.relative_to(ROOT)), "")
    return found


def test_no_function_is_over_80_lines():
    long = long_functions()
    assert long == {}, long


def test_no_rehearsal_global_outside_the_rehearsal_module():
    users = [str(p.relative_to(ROOT)) for p in PACKAGE.rglob("*.py") if "_REHEARSAL" in p.read_text()]
    assert users == [], users
