"""pytest fixtures and hooks; what the tests share otherwise is in tests/helpers.py.

The quick subset: `pytest -q -m "not slow" tests`. Collection marks every test that is not in it:
tests/distributed (`distributed`), tests/gpu (`gpu`), and each test elsewhere that starts a process
(`subprocess`: `run_cli`, `train_tiny`, `subprocess.*`, a library function that launches, in the test,
in a function of tests/ it calls or in a fixture it uses) gets `slow` too. A test the scan misses can
be marked `@pytest.mark.subprocess` by hand; one that started a Python process unmarked is named at
the end of the run (the audit hook below) so the quick subset stays quick.
"""

import inspect
import sys
import types
from pathlib import Path

import pytest

from tests.helpers import CORPUS

_HERE = Path(__file__).resolve().parent
_BY_DIRECTORY = {_HERE / "distributed": "distributed", _HERE / "gpu": "gpu"}
_NOT_QUICK = ("subprocess", "distributed", "gpu")
# names whose use in test code starts a process: the module, its class, and library functions that launch
_SPAWNS = frozenset({"subprocess", "Popen", "multiprocessing", "posix_spawn", "run_within_host_budget"})


@pytest.fixture
def corpus():
    if not CORPUS.is_file():
        pytest.skip(f"{CORPUS} not present")
    return CORPUS


@pytest.fixture(scope="module")
def megatron_single_rank():
    """A one-rank gloo group and Megatron's parallel state, for tests that build Megatron modules in process."""
    import socket

    import torch.distributed as dist
    from megatron.core import parallel_state

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    yield
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def _codes(code):
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):  # nested functions, lambdas, comprehensions
            yield from _codes(const)


def _ours(obj):
    return (getattr(obj, "__module__", None) or "").split(".")[0] == "tests"


def _ours_module(module):
    return module.__name__.split(".")[0] == "tests"


def _starts_a_process(fn, seen):
    """Whether fn's code, or that of a function of tests/ it names, names something in _SPAWNS."""
    fn = inspect.unwrap(getattr(fn, "__func__", fn))
    fn = getattr(getattr(fn, "hypothesis", None), "inner_test", fn)  # @given wraps the test
    code = getattr(fn, "__code__", None)
    if code is None or code in seen:
        return False
    seen.add(code)
    names = {name for c in _codes(code) for name in c.co_names}
    if names & _SPAWNS:
        return True
    space = getattr(fn, "__globals__", {})
    modules = [space.get(name) for name in names]  # `helpers.run_cli(...)`
    modules += [sys.modules.get(name) for name in names if name.startswith("tests.")]  # imported in the function
    spaces = [space] + [vars(m) for m in modules if isinstance(m, types.ModuleType) and _ours_module(m)]
    for name in names:
        for space in spaces:
            obj = space.get(name)
            if inspect.isfunction(obj) and _ours(obj) and _starts_a_process(obj, seen):
                return True
    return False


def _fixture_functions(item):
    info = getattr(item, "_fixtureinfo", None)
    for defs in (getattr(info, "name2fixturedefs", None) or {}).values():
        for fixturedef in defs:
            func = getattr(fixturedef, "func", None)
            if func is not None and _ours(func):
                yield func


def pytest_collection_modifyitems(config, items):
    verdicts = {}
    for item in items:
        for folder, name in _BY_DIRECTORY.items():
            if folder in item.path.parents and not item.get_closest_marker(name):
                item.add_marker(name)
        fn = getattr(item, "obj", None)
        if fn is not None and not any(item.get_closest_marker(m) for m in _NOT_QUICK):
            for f in [fn, *_fixture_functions(item)]:
                key = getattr(inspect.unwrap(getattr(f, "__func__", f)), "__code__", f)
                if key not in verdicts:
                    verdicts[key] = _starts_a_process(f, set())
                if verdicts[key]:
                    item.add_marker("subprocess")
                    break
        if any(item.get_closest_marker(m) for m in _NOT_QUICK) and not item.get_closest_marker("slow"):
            item.add_marker("slow")


# A Python process started during a test not marked slow: named at the end of the run (not a failure).
_running = {"item": None}
_unmarked = {}


def _audit(event, args):
    if event == "subprocess.Popen" and _running["item"] is not None:
        try:
            argv = [str(a) for a in (args[1] if isinstance(args[1], (list, tuple)) else [args[1]])]
            if argv and ("python" in Path(argv[0]).name or argv[0] == sys.executable or "torchrun" in argv[0]):
                _unmarked.setdefault(_running["item"], " ".join(argv)[:120])
        except Exception:  # an audit hook must never raise: that would stop the launch
            pass


sys.addaudithook(_audit)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _running["item"] = None if item.get_closest_marker("slow") else item.nodeid
    try:
        return (yield)
    finally:
        _running["item"] = None


def pytest_terminal_summary(terminalreporter):
    if _unmarked:
        terminalreporter.section("tests not marked slow that started a Python process")
        for nodeid, command in _unmarked.items():
            terminalreporter.write_line(f"{nodeid}: {command}")
        terminalreporter.write_line("mark them @pytest.mark.subprocess to keep `pytest -m 'not slow'` quick")
