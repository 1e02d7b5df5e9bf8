"""Facts about this machine and this checkout, read one way everywhere: host memory available (capped
by a cgroup limit), the C compiler, the commit that runs, and an exclusive file lock.

    from angelgpt.system import GIB, mem_available_bytes, c_compiler, git_commit, try_lock
"""

from __future__ import annotations

import os
import shutil
import subprocess
from typing import Optional

GIB = 1024 ** 3


def mem_available_bytes() -> int:
    """MemAvailable, capped by a cgroup memory limit (v2 or v1) when one is set."""
    available = None
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
    except OSError:
        pass
    for limit_file, usage_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            limit = open(limit_file).read().strip()
            if limit.isdigit() and int(limit) < (1 << 60):
                left = int(limit) - int(open(usage_file).read().strip())
                available = left if available is None else min(available, left)
        except OSError:
            continue
    return available if available is not None else 0


def c_compiler(compiler: Optional[str] = None) -> Optional[str]:
    """The C compiler native kernels are built with (`compiler`, else $CC, else cc, else gcc), as a path
    where it is found; None where it is not."""
    cc = compiler or os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    return shutil.which(cc) if cc else None


def git_commit(root: Optional[str] = None) -> str:
    """The angelgpt commit that runs: $ANGELGPT_COMMIT (a copied tree's caller names it), else TREE/.commit
    beside the package (a `git archive` tree), else git's HEAD of the checkout, else 'unknown'. `root`:
    another tree than this package's."""
    root = str(root or os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if os.environ.get("ANGELGPT_COMMIT"):
        return os.environ["ANGELGPT_COMMIT"]
    if os.path.isfile(os.path.join(root, ".commit")):
        return open(os.path.join(root, ".commit")).read().strip()
    try:
        return subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def try_lock(fd) -> Optional[bool]:
    """An exclusive, non-blocking flock on an open file (descriptor or file object): True when taken,
    False when another process holds it, None where the file system or platform has no flock (the
    kernel drops a lock when its holder dies)."""
    try:
        import fcntl
    except ImportError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError:
        return None
    return True
