"""A rehearsal held to its host memory budget: a rank whose plan needs more than its share of the
target node's host memory (--host-mem over the ranks per node) is refused before anything is built, and
the launcher's watcher kills a rehearsed process (children and all) that outgrows its limit while it runs."""

import sys
import textwrap
import time

import psutil
import pytest

from angelgpt.cli.budget import host_budget, over_budget_message, run_within_host_budget
from angelgpt.system import GIB
from tests.helpers import check_one_line_error, run_cli, wait_for


@pytest.mark.subprocess
def test_a_rank_whose_plan_outgrows_the_host_budget_is_refused_before_building(tmp_path):
    report = tmp_path / "out" / "rehearsal.json"
    start = time.monotonic()
    proc = run_cli("rehearse", "--size", "1.3b", "--device", "cpu", "--nproc-per-node", "8",
                   "--host-mem", "1", "train.train_iters=1", "--report", report, timeout=120)
    assert time.monotonic() - start < 60
    # both numbers: the plan's 1.8 GiB per rank and the budget, 1 GiB per node over 8 ranks
    check_one_line_error(proc, "needs 1.8 GiB of host memory, over its budget of 0.125 GiB (--host-mem 1 GiB")
    assert "rehearsing rank" not in proc.stdout  # nothing built
    assert not (tmp_path / "out").exists()  # nothing written


def _gone(p: psutil.Process) -> bool:
    try:
        return not p.is_running() or p.status() == psutil.STATUS_ZOMBIE
    except psutil.Error:
        return True


@pytest.mark.subprocess
def test_the_watcher_kills_a_process_that_outgrows_its_limit_children_and_all(tmp_path):
    pid_file = tmp_path / "grandchild.pid"
    grows = textwrap.dedent(f"""
        import subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        open({str(pid_file)!r}, "w").write(str(child.pid))
        held = []
        while True:  # 32 MiB written every 20 ms, for ever
            held.append(b"x" * (32 << 20))
            time.sleep(0.02)
    """)
    limit = int(0.3 * GIB)
    start = time.monotonic()
    w = run_within_host_budget([sys.executable, "-c", grows], limit)
    assert time.monotonic() - start < 10
    assert w.returncode == -9 and w.over_bytes is not None and w.over_bytes > limit
    assert w.peak_rss_bytes >= w.over_bytes
    message = over_budget_message(w.over_bytes, limit, limit, "a test's")
    assert message.startswith("used ") and "of host memory, over its budget of 0.3 GiB (a test's)" in message
    grandchild = psutil.Process(int(pid_file.read_text()))
    assert wait_for(lambda: _gone(grandchild), timeout=5)  # no process left behind


@pytest.mark.subprocess
def test_the_watcher_lets_a_process_within_its_limit_finish():
    w = run_within_host_budget([sys.executable, "-c", "import sys; sys.stderr.write('fine\\n')"], GIB)
    assert (w.returncode, w.stderr, w.over_bytes) == (0, "fine\n", None)


def test_the_limit_is_the_budget_or_what_this_machine_can_give_where_that_is_less():
    # a GPU rehearsal: the share of the node's host memory
    assert host_budget(2 * GIB, "--host-mem 16 GiB per node over 8 ranks", True, 80 * GIB, 64 * GIB)[:2] == \
        (2 * GIB, 2 * GIB)
    # on the CPU the target GPU's memory is held here too; a target without GPUs has only its share
    assert host_budget(2 * GIB, "x", False, 8 * GIB, 64 * GIB)[:2] == (10 * GIB, 10 * GIB)
    assert host_budget(2 * GIB, "x", False, 0, 64 * GIB)[:2] == (2 * GIB, 2 * GIB)
    # more than this machine has: held to its available memory, less a reserve before its OOM killer
    limit, budget, why = host_budget(2 * GIB, "x", False, 80 * GIB, 20 * GIB)
    assert budget == 82 * GIB and limit == 18 * GIB and "this machine" in why
    assert "over the 18 GiB this machine can give it" in over_budget_message(19 * GIB, limit, budget, why)
