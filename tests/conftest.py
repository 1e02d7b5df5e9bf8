"""pytest fixtures and hooks; what the tests share otherwise is in tests/helpers.py.

The quick subset, `pytest -q -m "not slow" tests`, is every test not marked `slow`. Marks are explicit:
tests/distributed is marked `distributed` and tests/gpu `gpu` by folder (below); a test elsewhere that
starts a process (the `angelgpt` CLI, a script, pip, torchrun) carries `@pytest.mark.subprocess`, and
one that takes long in process `@pytest.mark.slow` (its module's `pytestmark` where all of them do; a
parametrized matrix keeps one case quick with tests.helpers.one_quick). Every `distributed`, `gpu` or
`subprocess` test is `slow` too. A test not marked `slow` that starts a Python process fails (the
audit hook below), so a launch cannot slip into the quick subset unmarked.
"""

import sys
from pathlib import Path

import pytest

from tests.helpers import CORPUS

_HERE = Path(__file__).resolve().parent
_BY_DIRECTORY = {_HERE / "distributed": "distributed", _HERE / "gpu": "gpu"}
_NOT_QUICK = ("subprocess", "distributed", "gpu")


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


def pytest_collection_modifyitems(config, items):
    for item in items:
        for folder, name in _BY_DIRECTORY.items():
            if folder in item.path.parents and not item.get_closest_marker(name):
                item.add_marker(name)
        if any(item.get_closest_marker(m) for m in _NOT_QUICK) and not item.get_closest_marker("slow"):
            item.add_marker("slow")


# A Python process started by a test not marked slow (in its setup, call or teardown) fails that test.
_running = {"item": None}
_unmarked = {}  # nodeid -> the command it started
_failed = set()
_BIN = Path(sys.executable).parent  # the environment's console scripts (angelgpt, torchrun, pip) run Python
_SHELLS = ("sh", "bash", "dash", "zsh")


def _runs_python(argv):
    name = Path(argv[0]).name
    if name in _SHELLS:  # `sh -c "python ..."`
        return any(word in " ".join(argv[1:]) for word in ("python", "angelgpt", "torchrun", "pip"))
    return "python" in name or "torchrun" in name or argv[0] == sys.executable or Path(argv[0]).parent == _BIN


def _audit(event, args):
    if _running["item"] is None or _running["item"] in _unmarked:
        return
    try:
        if event == "os.fork":  # the child is a copy of this Python process
            _unmarked[_running["item"]] = "os.fork()"
        elif event in ("subprocess.Popen", "os.posix_spawn"):  # (executable or path, argv, ...)
            argv = [str(a) for a in (args[1] if isinstance(args[1], (list, tuple)) else [args[1]])]
            if argv and _runs_python(argv):
                _unmarked[_running["item"]] = " ".join(argv)[:120]
    except Exception:  # an audit hook must never raise: that would stop the launch, not fail the test
        pass


sys.addaudithook(_audit)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _running["item"] = None if item.get_closest_marker("slow") else item.nodeid
    try:
        return (yield)
    finally:
        _running["item"] = None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if item.nodeid in _unmarked and item.nodeid not in _failed:  # the phase (setup, call, teardown) that launched
        _failed.add(item.nodeid)
        message = (f"started a Python process but is not marked slow: {_unmarked[item.nodeid]}\n"
                   "mark it @pytest.mark.subprocess to keep `pytest -m 'not slow'` in process")
        if report.failed:  # its own failure stays what it shows
            report.sections.append(("not marked slow", message))
        else:
            report.outcome = "failed"
            report.longrepr = message
            if hasattr(report, "wasxfail"):  # a launch fails the test even where it was expected to fail
                del report.wasxfail
    return report


def pytest_terminal_summary(terminalreporter):
    if _unmarked:
        terminalreporter.section("tests not marked slow that started a Python process (failed)")
        for nodeid, command in _unmarked.items():
            terminalreporter.write_line(f"{nodeid}: {command}")
        terminalreporter.write_line("mark them @pytest.mark.subprocess to keep `pytest -m 'not slow'` in process")
