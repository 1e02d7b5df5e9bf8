"""A run's lifetime: one run per checkpoint directory (a lock the launcher holds), and no run that
outlives its launcher (the torchrun agent dies with it; the workers watch it). No torch import here."""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import threading
import time
from typing import Callable, Optional

from angelgpt.system import try_lock

LOCK_NAME = ".angelgpt.lock"
LAUNCHER_PID_ENV = "ANGELGPT_LAUNCHER_PID"
_PR_SET_PDEATHSIG = 1


class DirectoryInUse(Exception):
    """The checkpoint directory is locked by another live run; the message names it."""


class RunLock:
    """An exclusive flock on DIR/.angelgpt.lock, holding the holder's host and PID, for as long as the
    process keeps it (the kernel drops it when the holder dies, so a dead run's lock is free)."""

    def __init__(self, directory: str):
        self.path = os.path.join(directory, LOCK_NAME)
        self._fd: Optional[int] = None
        os.makedirs(directory, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)  # no O_TRUNC: a refused run changes nothing
        taken = try_lock(fd)
        if taken is False:
            holder = _holder(fd)
            os.close(fd)
            raise DirectoryInUse(f"checkpoint directory {directory} is in use by another run ({holder}); "
                                 f"stop it or save elsewhere")
        if taken is None:  # not POSIX, or a file system without flock (some network mounts): run unlocked
            os.close(fd)
            return
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                                   "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}) + "\n").encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # the record stays: it is only read while the lock is held
            self._fd = None


def take_save_lock(save: Optional[str], nnodes: int = 1, node_rank: int = 0,
                   rdzv_endpoint: Optional[str] = None) -> Optional[RunLock]:
    """The launcher's lock on its checkpoint directory, or None without one. Of several nodes only the one
    with --node-rank 0 locks (their directory may be one shared one); with elastic rendezvous (every node's
    node rank is 0 here) none does. A locked or unusable directory raises ConfigError (one line, exit 2)."""
    from angelgpt.config import ConfigError

    if not save or (nnodes > 1 and (node_rank != 0 or rdzv_endpoint)):
        return None
    try:
        return RunLock(save)
    except DirectoryInUse as exc:
        raise ConfigError(str(exc)) from None
    except OSError as exc:
        raise ConfigError(f"checkpoint.save {save} cannot be used: {exc.strerror or exc}") from None


def _holder(fd: int) -> str:
    """'host H, PID P' from the lock file (the holder writes it right after locking: wait briefly)."""
    for _ in range(20):
        try:
            record = json.loads(os.pread(fd, 4096, 0).decode())
            return f"host {record['host']}, PID {record['pid']}"
        except (ValueError, KeyError, OSError):
            time.sleep(0.05)
    return "host and PID not recorded"


def agent_preexec() -> Optional[Callable[[], None]]:
    """Popen's preexec_fn for the torchrun agent: on Linux it gets SIGKILL when the launcher dies, by
    whatever signal (SIGKILL, not SIGTERM: torchrun would pass SIGTERM on to the workers, which would save).
    None where there is no prctl; the workers' watchdog still ends the run."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        prctl = libc.prctl
    except (OSError, AttributeError):
        return None
    launcher = os.getpid()

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != launcher:  # the launcher died before the line above
            os._exit(1)

    return preexec


def watch_launcher(interval: float = 0.2) -> None:
    """In a worker started by `angelgpt train`: a daemon thread that ends this process at once when the
    launcher (ANGELGPT_LAUNCHER_PID) or the torchrun agent that started this worker is gone, so a launcher
    killed by SIGKILL leaves no training behind. Does nothing for a worker started without the launcher."""
    pid = os.environ.get(LAUNCHER_PID_ENV, "")
    if not pid.isdigit():
        return
    try:
        import psutil
    except ImportError:
        return
    agent = os.getppid()
    try:
        launcher = psutil.Process(int(pid))
    except psutil.Error:
        launcher = None

    def alive() -> bool:
        if os.getppid() != agent or launcher is None:
            return False
        try:  # is_running() tells a reused PID apart; a killed launcher not yet reaped is a zombie
            return launcher.is_running() and launcher.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False

    def watch() -> None:
        while alive():
            time.sleep(interval)
        try:
            print(f"angelgpt: rank {os.environ.get('RANK', '0')}: the launcher (PID {pid}) or its torchrun agent "
                  f"is gone; stopping", file=sys.stderr, flush=True)
        except Exception:  # its stderr was a pipe to the launcher
            pass
        os._exit(1)

    if not alive():
        os._exit(1)
    threading.Thread(target=watch, name="angelgpt-launcher-watchdog", daemon=True).start()
