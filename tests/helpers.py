"""What the tests share: run the real `angelgpt` CLI in a subprocess, read its metrics file, train the
tiny preset, check a one-line CLI error.

Tests import these from here (`from tests.helpers import ...`), never from conftest.py or from one
another; conftest.py holds only pytest fixtures and hooks.
"""

import contextlib
import io
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
# the shared corpus beside the checkout when present, else the public-domain copy kept with the tests
_SHARED = ROOT.parent / "shared" / "data" / "tinyshakespeare.txt"
CORPUS = _SHARED if _SHARED.is_file() else ROOT / "tests" / "data" / "tinyshakespeare.txt"


def one_quick(quick, cases):
    """parametrize's values: each of `cases` (values, or tuples of them for several names), the one equal to
    `quick` in the quick subset and the others marked slow, e.g. `pytest.mark.parametrize("a,b",
    one_quick(("x", 1), itertools.product(["x", "y"], [1, 2])))`."""
    import pytest

    cases = list(cases)
    assert quick in cases, quick
    return [pytest.param(*(c if isinstance(c, tuple) else (c,)), marks=() if c == quick else pytest.mark.slow)
            for c in cases]


def run_cli(*args, timeout=600, env=None):
    full_env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-m", "angelgpt", *map(str, args)], cwd=ROOT, text=True,
                          capture_output=True, timeout=timeout, env=full_env)


def read_metrics(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def train_tiny(tmp_path, name, *overrides, nproc=1, with_output=False):
    """Trains the tiny preset on CPU and returns its per-iteration metrics (and its stdout)."""
    metrics = tmp_path / f"{name}.jsonl"
    proc = run_cli("train", "--size", "tiny", "--device", "cpu", "--nproc-per-node", nproc,
                   "--metrics-file", metrics, "logging.log_interval=1", *overrides)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return (read_metrics(metrics), proc.stdout) if with_output else read_metrics(metrics)


def resume_point(saved, iteration: int, dest):
    """A checkpoint directory whose latest checkpoint is `saved`'s of `iteration` (a copy): what a run
    stopped there would have left, taken from the uninterrupted run that saved it on its way."""
    import shutil

    from angelgpt.train.checkpoint_check import TRACKER, iter_dir

    shutil.copytree(iter_dir(Path(saved), iteration), iter_dir(Path(dest), iteration))
    (Path(dest) / TRACKER).write_text(f"{iteration}\n")
    return Path(dest)


def check_one_line_error(proc, needle, in_worker=False):
    """A bad input's answer: exit code 2, one line on stderr naming the problem, no traceback, and
    (unless the worker found it) nothing launched."""
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("angelgpt: error: ") and needle in lines[0], lines[0]
    assert "Traceback" not in proc.stderr + proc.stdout
    if not in_worker:
        assert "torchrun command" not in proc.stdout  # refused before launching


def wait_for(cond, timeout=120.0, poll=0.005):
    """True once cond() holds, False after timeout seconds."""
    end = time.time() + timeout
    while time.time() < end:
        if cond():
            return True
        time.sleep(poll)
    return False


def run_cli_in_process(*args):
    """`angelgpt ARGS` in this process (no interpreter start-up): returncode, stdout, stderr."""
    from angelgpt.cli.app import main

    out, err = io.StringIO(), io.StringIO()
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main([str(a) for a in args])
        except SystemExit as exc:
            code = exc.code
    return SimpleNamespace(returncode=code, stdout=out.getvalue(), stderr=err.getvalue())


def dry_run(tmp_path, *args):
    """`angelgpt train --dry-run ARGS` with its run config written under tmp_path: the finished process
    and the torchrun command it printed, as a list of arguments (None when it printed none)."""
    proc = run_cli("train", "--dry-run", *args, env={"TMPDIR": str(tmp_path)})
    line = next((l for l in proc.stdout.splitlines() if l.startswith("torchrun command: ")), "")
    cmd = shlex.split(line.partition(": ")[2]) if proc.returncode == 0 and "--run-config" in line else None
    return proc, cmd


def run_config_in(cmd):
    """The path a worker command's `--run-config` names."""
    return cmd[cmd.index("--run-config") + 1]


def train_shared_gpu(tmp_path, name, *overrides, nproc=1, size="tiny", timeout=300, check=True):
    """Trains on GPU 0 with `nproc` torchrun ranks sharing it under a gloo default group
    (tests/gpu/shared_gpu_worker.py: tests/shared_device.py's SharedDevice) on the run config a dry run
    resolves and writes (--force: the planner counts a GPU a rank), and returns the per-iteration
    metrics; with check=False, the finished process instead (the dry run's, if it refused)."""
    metrics = tmp_path / f"{name}.jsonl"
    proc, printed = dry_run(tmp_path, "--size", size, "--device", "cuda", "--nproc-per-node", nproc, "--force",
                            f"logging.metrics_file={metrics}", "logging.log_interval=1", *overrides)
    if printed is None:
        assert not check, failure_report(proc)
        return proc
    # the workers share torchrun's store, as angelgpt's launcher has them do without restarts (a store of
    # their own listens on a port torchrun found free and let go, which a test beside this one may take)
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           str(ROOT / "tests" / "gpu" / "shared_gpu_worker.py"), "--run-config", run_config_in(printed)]
    proc = subprocess.run(cmd, cwd=ROOT, text=True, capture_output=True, timeout=timeout, env=env)
    if not check:
        return proc
    assert proc.returncode == 0, failure_report(proc)
    return read_metrics(metrics)


def failure_report(proc, head: int = 40, tail: int = 4000) -> str:
    """A failed run's output for an assertion: the first error lines of stderr (a crash's own message,
    which a rank's later teardown noise pushes out of the tail) and the tails of stdout and stderr."""
    lines = proc.stderr.splitlines()
    first = next((i for i, line in enumerate(lines) if any(
        k in line for k in ("Error", "error", "Traceback", "Fatal", "Segmentation", "Aborted", "terminate"))), None)
    parts = [] if first is None else ["--- first error lines ---", *lines[first:first + head]]
    return "\n".join([*parts, "--- stdout tail ---", proc.stdout[-tail:], "--- stderr tail ---", proc.stderr[-tail:]])


def processes_of(ck):
    """Processes still running whose command line names a run's (unique) checkpoint directory."""
    import psutil

    found = []
    for p in psutil.process_iter():
        try:
            if str(ck) in " ".join(p.cmdline()) and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
        except psutil.Error:
            pass
    return found
