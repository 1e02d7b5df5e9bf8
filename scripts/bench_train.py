"""Training throughput benchmark: runs `angelgpt train` and writes one result file.

    python scripts/bench_train.py --name h200-5b-megatron --size h200-5b --iters 12 --warmup 4 \
        --goal-tflops 540 -- optim.optimizer=megatron
    python scripts/bench_train.py --runner deepspeed --name ds-L7 --size h200-16b -- model.num_layers=7

The result JSON (under --out, default benchmarks/results/) holds the exact command, the commit, the
machine (with its boot id), the device call it ran in (`call`: ANGELGPT_BENCH_CALL, which the calling
shell sets once per device call, else the machine's hostname and boot id), the config the run was given
(`config`, every field), per-iteration records, and medians after warm-up of TFLOP/s/GPU and tokens/s,
and peak memory. Two files compare fairly only when they share `call` and `machine`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


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


# lines of a run's output that say what it settled: the launcher's plan and resolution, the
# optimizer's placement, a worker that resolved differently (earlier commits' wording included)
SETTINGS = ("plan:", "resolved:", "zero_cache:", "model.recompute auto", "built model", "angelgpt: rank 0: the workers")


def commit(root=ROOT) -> str:
    if (Path(root) / ".commit").is_file():  # a copied tree (no .git) names its commit in this file
        return (Path(root) / ".commit").read_text().strip()
    if os.environ.get("ANGELGPT_COMMIT"):
        return os.environ["ANGELGPT_COMMIT"]
    try:
        return subprocess.check_output(["git", "rev-parse", "HEAD"], cwd=root, text=True).strip()
    except Exception:
        return "unknown"


def new_result_path(out, name: str) -> Path:
    """out/NAME.json, or out/NAME-runN.json with the first N from 2 not taken: a result file is never
    overwritten, a run again of a case gets the next number. Makes `out`."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    path, n = out / f"{name}.json", 2
    while path.exists():
        path, n = out / f"{name}-run{n}.json", n + 1
    return path


def given_config(size: str, overrides) -> dict:
    """Every field of the config the run was given ('auto' as given; the run's `settings` lines say
    what it resolved to), so that a default that changes later is still on record."""
    try:
        from angelgpt.config import resolve, to_dict

        return to_dict(resolve(size, None, list(overrides)))
    except Exception as exc:  # the run itself reports bad input; angelgpt not importable here: said so
        return {"error": f"{type(exc).__name__}: {exc}"}


def predicted(size: str, overrides, machine_info: dict) -> dict:
    """The planner's prediction for this run on this machine (peak GPU and host memory, step time)."""
    from dataclasses import replace

    from angelgpt.config import resolve
    from angelgpt.planner import GIB, MACHINES, plan_for
    from angelgpt.zero_cache.placement import CHUNK

    try:
        cfg = resolve(size, None, list(overrides))
    except Exception as exc:  # the run itself reports bad input
        return {"error": str(exc)}
    hw = MACHINES["h200"]
    if machine_info.get("gpu_mem_gib"):
        hw = replace(hw, gpu_mem_gib=machine_info["gpu_mem_gib"])
    p = plan_for(cfg, hw)
    return {"system": p.system, "rate": p.rate, "gpu_gib": round(p.gpu_total / GIB, 2),
            "host_gib": round(p.host_total / GIB, 2), "step_time_s": p.step_time_s,
            "bottleneck": p.bottleneck, "fits": p.fits, "accumulate_in_store": p.accumulate_in_store,
            "device_update_fraction": p.device_update_fraction, "recompute": p.recompute_label(),
            "chunk_numel": CHUNK}


def failure(tail: str, returncode: int) -> dict:
    """Why a run completed no step, from the end of its output: oom (out of memory, or refused before
    launch because the planner found memory short), oom_kind ('gpu', 'host', 'gpu and host') and, for a
    refusal, what was short ("short of gpu by 4.28 GiB, host by 1.42 GiB")."""
    refused = re.search(r"does not fit \(\w+: short of ([^)]*)\)", tail)
    short = [k for k in ("gpu", "host") if refused and f"{k} by" in refused.group(1)]
    gpu_oom = "out of memory" in tail.lower() or "do not fit" in tail
    # the kernel's OOM killer: torchrun reports it, a process run directly dies of signal 9
    host_oom = "Signal 9 (SIGKILL)" in tail or "killed by SIGKILL" in tail or returncode == -9
    out = {"oom": bool(short) or gpu_oom or host_oom,
           "oom_kind": " and ".join(short) if short else "gpu" if gpu_oom else "host" if host_oom else None}
    if refused:
        out["refused"] = "short of " + refused.group(1)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--name", required=True)
    ap.add_argument("--size", required=True)
    ap.add_argument("--iters", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--goal-tflops", type=float, default=None)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--runner", choices=("angelgpt", "deepspeed"), default="angelgpt",
                    help="deepspeed: the same config trained by DeepSpeed ZeRO-3 offload (scripts/bench_deepspeed.py)")
    ap.add_argument("--root", default=str(ROOT),
                    help="the angelgpt checkout to run (another commit's tree, for a before/after pair in one call)")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    if args.iters <= args.warmup:
        print("bench_train: --iters must exceed --warmup", file=sys.stderr)
        return 2

    metrics = Path(tempfile.mkdtemp()) / "metrics.jsonl"
    program = ["-m", "angelgpt", "train"] if args.runner == "angelgpt" else ["scripts/bench_deepspeed.py"]
    cmd = [sys.executable, *program, "--size", args.size, "--metrics-file", str(metrics),
           f"train.train_iters={args.iters}", "logging.log_interval=1", *args.overrides]
    printable = "python " + " ".join(shlex.quote(c) for c in cmd[1:] if c != str(metrics) and c != "--metrics-file")
    print("running:", printable, flush=True)
    start = time.time()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (args.root, os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.run(cmd, cwd=args.root, text=True, capture_output=True, env=env)
    sys.stdout.write(proc.stdout[-6000:])
    sys.stderr.write(proc.stderr[-6000:])
    records = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    steady = [r for r in records if r["iteration"] > args.warmup]
    result = {
        "name": args.name,
        "command": printable,
        "bench_command": "python scripts/bench_train.py " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
        "commit": commit(args.root),
        "call": call_id(),
        "machine": machine(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "returncode": proc.returncode,
        "wall_s": round(time.time() - start, 1),
        "warmup_iters": args.warmup,
        "records": records,
        # what the launcher and the workers said they settled ('auto' resolved, placement)
        "settings": [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith(SETTINGS)],
    }
    if steady:
        result.update(
            tflops_per_gpu_median=statistics.median(r["tflops_per_gpu"] for r in steady),
            tokens_per_s_median=statistics.median(r["tokens_per_s"] for r in steady),
            elapsed_ms_median=statistics.median(r["elapsed_ms"] for r in steady),
            peak_gpu_gib=max(r["mem_gpu_gib"] for r in records),
            peak_gpu_reserved_gib=max(r.get("mem_gpu_reserved_gib", 0.0) for r in records),
            peak_host_gib=max(r["mem_host_gib"] for r in records),
        )
        if args.goal_tflops:
            result["goal_tflops_per_gpu"] = args.goal_tflops
            result["goal_met"] = result["tflops_per_gpu_median"] >= args.goal_tflops
    result["config"] = given_config(args.size, args.overrides)
    if args.runner == "angelgpt":
        result["predicted"] = predicted(args.size, args.overrides, result["machine"])
    if steady:
        result["oom"] = False
    else:
        tail = proc.stdout[-20000:] + proc.stderr[-20000:]
        result.update(failure(tail, proc.returncode), log_tail=tail[-4000:])
    path = new_result_path(args.out, args.name)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}: " + json.dumps({k: v for k, v in result.items() if k.endswith("median") or k.startswith("goal")
                                           or k.startswith("peak")}))
    return 0 if proc.returncode == 0 and steady else 1


if __name__ == "__main__":
    sys.exit(main())
