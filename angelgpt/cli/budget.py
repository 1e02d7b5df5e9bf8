"""A rehearsed rank held to its host-memory budget: the budget and the limit it gets on this machine
(`host_budget`), and a launcher that watches the rank's resident memory, children included, and stops
it when it passes the limit (`run_within_host_budget`), rather than leaving it to the kernel's
out-of-memory killer, which may pick another process on a shared machine.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
from dataclasses import dataclass
from typing import List, Optional

from angelgpt.system import GIB

WATCH_INTERVAL_S = 0.2  # how often the launcher reads a rehearsed rank's RSS
# of this machine's available host memory, what a rehearsed rank may not take: a poll's worth of growth
# (a rank on the CPU fills GiBs a second) before the kernel's out-of-memory killer would act
HERE_RESERVE_FRACTION, HERE_RESERVE_MIN = 0.1, GIB


@dataclass
class Watched:
    """A command run by run_within_host_budget: its exit code, its stderr (None unless captured), the peak
    RSS the watcher saw (the process and its descendants), and that RSS when it went over the limit and
    the watcher killed it (None when it did not)."""
    returncode: int
    stderr: Optional[str]
    peak_rss_bytes: int
    over_bytes: Optional[int] = None


def _tree(proc) -> list:
    """psutil Process proc and its descendants (those still there)."""
    import psutil

    try:
        return [proc] + proc.children(recursive=True)
    except psutil.Error:
        return []


def _rss(procs) -> int:
    import psutil

    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.Error:  # gone, a zombie, or not ours to read
            continue
    return total


def run_within_host_budget(cmd: List[str], limit_bytes: int, env: Optional[dict] = None, preexec_fn=None,
                           capture_stderr: bool = True, interval: float = WATCH_INTERVAL_S) -> Watched:
    """Runs cmd in a process group of its own while a thread reads the RSS of it and its descendants
    every `interval` s; on the first reading over limit_bytes it kills the group and every descendant
    seen (SIGKILL) and the command's result says so (over_bytes). Any process of the command still there
    when it ends, or when the caller is interrupted, is killed too: none outlives this call. (A resource
    limit such as RLIMIT_AS would count the address space torch and CUDA reserve, not the memory used.)"""
    import psutil

    def preexec() -> None:
        os.setpgid(0, 0)  # the group the watcher kills: descendants the last poll did not see included
        if preexec_fn is not None:
            preexec_fn()

    child = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE if capture_stderr else None,
                             text=capture_stderr or None, errors="replace" if capture_stderr else None,
                             preexec_fn=preexec)
    try:
        root = psutil.Process(child.pid)
    except psutil.Error:  # gone already
        root = None
    seen: dict = {}
    state = {"peak": 0, "over": None}
    lock, stop = threading.Lock(), threading.Event()

    def kill() -> None:
        with lock:
            if child.returncode is None:  # not reaped: its PID, and so its group, is still its own
                try:
                    os.killpg(child.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            for p in list(seen.values()):  # psutil checks the process is still the one it saw
                try:
                    p.kill()
                except psutil.Error:
                    pass

    def watch() -> None:
        while root is not None and not stop.is_set():
            procs = _tree(root)
            for p in procs:
                seen.setdefault(p.pid, p)
            rss = _rss(procs)
            state["peak"] = max(state["peak"], rss)
            if rss > limit_bytes:
                state["over"] = rss
                kill()
                return
            stop.wait(interval)

    watcher = threading.Thread(target=watch, name="angelgpt-rehearsal-host-watch", daemon=True)
    watcher.start()
    try:
        _, err = child.communicate()
    except BaseException:
        kill()
        child.wait()
        raise
    finally:
        stop.set()
        watcher.join()
    kill()  # whatever it left behind (nothing, normally)
    return Watched(child.returncode, err, state["peak"], state["over"])


def gib3(b) -> str:
    """GiB to three decimals at most, trailing zeros dropped: 0.125, 1.8, 14.4."""
    return f"{b / GIB:.3f}".rstrip("0").rstrip(".") + " GiB"


def host_budget(share_bytes: int, source: str, on_gpu: bool, target_gpu_bytes: int, here_available: int):
    """A rehearsed rank's host memory limit and its account: (limit bytes, budget bytes, what the budget
    is). Its budget is the target node's host memory per rank (share_bytes; `source` says where that
    came from); on a CPU rehearsal, where the CPU holds what the target's GPU would, plus that GPU's
    memory (target_gpu_bytes; 0 for a target without GPUs, whose ranks have only their host share). The
    limit is the budget, or what this machine can give the rank (here_available less a reserve) where
    that is less."""
    budget, why = share_bytes, f"{gib3(share_bytes)} per rank: {source}"
    if not on_gpu and target_gpu_bytes:
        budget += target_gpu_bytes
        why += f", plus the target GPU's {gib3(target_gpu_bytes)}, held here by the CPU"
    here = here_available - max(HERE_RESERVE_MIN, int(here_available * HERE_RESERVE_FRACTION))
    if 0 < here < budget:
        return here, budget, (f"this machine's available {gib3(here_available)} less a reserve; its budget of "
                              f"{gib3(budget)} ({why}) is more than this machine has")
    return budget, budget, why


def over_budget_message(used: int, limit: int, budget: int, why: str) -> str:
    """'used X GiB of host memory, over its budget of Y GiB (why)', X to as many decimals as tell it from Y."""
    digits = next((d for d in range(2, 7) if f"{used / GIB:.{d}f}" != f"{limit / GIB:.{d}f}"), 6)
    used_text = f"{used / GIB:.{digits}f} GiB"
    if limit < budget:
        return f"used {used_text} of host memory, over the {gib3(limit)} this machine can give it ({why})"
    return f"used {used_text} of host memory, over its budget of {gib3(budget)} ({why})"
