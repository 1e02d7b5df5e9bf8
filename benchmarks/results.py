"""Result files: the one writer, and their reading by case.

A result file is benchmarks/results/NAME.json (or another directory's), a run again of the same case
NAME-runN.json with the first N from 2 not taken: a file is never overwritten (it is created
exclusively). Every file starts with `stamp`'s fields: its name, the command that made it, the commit
measured, the device call, the machine and the date; `write_result` refuses a result without them.

    python -m benchmarks.results path DIR NAME     # the path the next run of NAME would take
"""

from __future__ import annotations

import json
import os
import platform
import re
import shlex
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
STAMPED = ("name", "command", "commit", "machine")


def boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return "unknown"


def call_id() -> str:
    """The device call a run belongs to: ANGELGPT_BENCH_CALL when the calling shell set it (once per
    call), else this machine's hostname and boot id (every run since the machine started)."""
    return os.environ.get("ANGELGPT_BENCH_CALL") or f"{platform.node()}:{boot_id()}"


def machine() -> dict:
    info = {"host": platform.node(), "boot_id": boot_id(), "python": platform.python_version(),
            "cpus": os.cpu_count()}
    try:
        info["host_mem_gib"] = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        pass
    try:
        import torch

        info["torch"] = torch.__version__
        if torch.cuda.is_available():
            p = torch.cuda.get_device_properties(0)
            info.update(gpu=p.name, gpu_count=torch.cuda.device_count(), gpu_mem_gib=round(p.total_memory / 2**30, 1),
                        cuda=torch.version.cuda)
            if getattr(p, "uuid", None) is not None:
                info["gpu_uuid"] = str(p.uuid)
    except ImportError:
        pass
    return info


def commit(root=ROOT) -> str:
    """The commit a result comes from, as angelgpt names the commit that runs (angelgpt.system.git_commit)."""
    from angelgpt.system import git_commit

    return git_commit(root)


def invocation() -> str:
    """This process's command as one would type it again from the repository root:
    `python -m benchmarks.X ARGS` or `python scripts/bench_X.py ARGS`."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is not None and spec.name:  # python -m
        head = ["-m", spec.name.removesuffix(".__main__")]
    else:
        program = Path(sys.argv[0]).resolve()
        head = [str(program.relative_to(ROOT)) if program.is_relative_to(ROOT) else sys.argv[0]]
    return "python " + shlex.join([*head, *sys.argv[1:]])


def stamp(name: str, command: str, root=ROOT) -> dict:
    """The fields every result file starts with. `root`: the tree whose commit was measured."""
    return {"name": name, "command": command, "commit": commit(root), "call": call_id(), "machine": machine(),
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def new_result_path(out, name: str) -> Path:
    """out/NAME.json, or out/NAME-runN.json with the first N from 2 not taken (a run again of a case
    gets the next number). Makes `out`. For a file another program writes; write_result reserves its own."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    path, n = out / f"{name}.json", 2
    while path.exists():
        path, n = out / f"{name}-run{n}.json", n + 1
    return path


def write_result(out, result: dict, indent: int = 2) -> Path:
    """Writes `result` (which holds stamp's fields) as out/NAME.json or out/NAME-runN.json, never over an
    existing file (created exclusively, so two writers at once take two numbers). Returns its path."""
    missing = [k for k in STAMPED if k not in result]
    if missing:
        raise ValueError(f"a result file needs {', '.join(missing)} (benchmarks.results.stamp)")
    text = json.dumps(result, indent=indent) + "\n"
    while True:
        path = new_result_path(out, result["name"])
        try:
            with open(path, "x") as fh:
                fh.write(text)
            return path
        except FileExistsError:  # taken since new_result_path looked
            continue


def case_of(path: Path) -> str:
    return re.sub(r"-run\d+$", "", Path(path).stem)


def runs_by_case(results: Path, pattern: str = "*.json") -> dict:
    """{case: [(path, result), ...]} oldest first: by date, then by run number."""
    cases: dict = {}
    for f in sorted(Path(results).glob(pattern)):
        try:
            r = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(r, dict):
            cases.setdefault(case_of(f), []).append((f, r))
    for runs in cases.values():
        runs.sort(key=lambda fr: (fr[1].get("date", ""), int((re.findall(r"-run(\d+)$", fr[0].stem) or [1])[0])))
    return cases


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 3 or args[0] != "path":
        print("usage: python -m benchmarks.results path DIR NAME", file=sys.stderr)
        return 2
    print(new_result_path(args[1], args[2]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
