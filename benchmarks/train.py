"""Training throughput benchmark: runs `angelgpt train` and writes one result file.

    python scripts/bench_train.py --name h200-5b-megatron --size h200-5b --iters 12 --warmup 4 \
        --goal-tflops 540 -- optim.optimizer=megatron
    python scripts/bench_train.py --runner deepspeed --name ds-L7 --size h200-16b -- model.num_layers=7

(`python -m benchmarks.train ...` is the same.) The result JSON (under --out, default
benchmarks/results/; benchmarks.results writes it) holds the exact command, the commit, the machine
(with its boot id), the device call it ran in (`call`: ANGELGPT_BENCH_CALL, which the calling shell sets
once per device call, else the machine's hostname and boot id), the config the run was given (`config`,
every field), per-iteration records, and medians after warm-up of TFLOP/s/GPU and tokens/s, and peak
memory. Two files compare fairly only when they share `call` and `machine`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.results import RESULTS, ROOT, invocation, stamp, write_result

# lines of a run's output that say what it settled: the launcher's plan and resolution, the
# optimizer's placement, a worker that resolved differently (earlier commits' wording included)
SETTINGS = ("plan:", "resolved:", "zero_cache:", "model.recompute auto", "built model", "angelgpt: rank 0: the workers")


def given_config(size: str, overrides) -> dict:
    """Every field of the config the run was given ('auto' as given; the run's `settings` lines say
    what it resolved to), so that a default that changes later is still on record."""
    try:
        from angelgpt.config import parse, to_dict

        return to_dict(parse(size, None, list(overrides)))
    except Exception as exc:  # the run itself reports bad input; angelgpt not importable here: said so
        return {"error": f"{type(exc).__name__}: {exc}"}


def predicted(size: str, overrides, machine_info: dict) -> dict:
    """The planner's prediction for this run on this machine (peak GPU and host memory, step time)."""
    from dataclasses import replace

    from angelgpt.config import parse
    from angelgpt.planner import GIB, MACHINES, plan_for

    try:
        cfg = parse(size, None, list(overrides))
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
            "chunk_numel": cfg.zero_cache.chunk_numel}


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


def deepspeed_program(root) -> list:
    """The DeepSpeed peer of the tree being run: its benchmarks.deepspeed_peer, or in a tree from before
    the benchmarks package its scripts/bench_deepspeed.py."""
    if (Path(root) / "benchmarks" / "deepspeed_peer.py").is_file():
        return ["-m", "benchmarks.deepspeed_peer"]
    return ["scripts/bench_deepspeed.py"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--name", required=True)
    ap.add_argument("--size", required=True)
    ap.add_argument("--iters", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--goal-tflops", type=float, default=None)
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--runner", choices=("angelgpt", "deepspeed"), default="angelgpt",
                    help="deepspeed: the same config trained by DeepSpeed (benchmarks/deepspeed_peer.py)")
    ap.add_argument("--root", default=str(ROOT),
                    help="the angelgpt checkout to run (another commit's tree, for a before/after pair in one call)")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    if args.iters <= args.warmup:
        print("bench_train: --iters must exceed --warmup", file=sys.stderr)
        return 2

    metrics = Path(tempfile.mkdtemp()) / "metrics.jsonl"
    program = ["-m", "angelgpt", "train"] if args.runner == "angelgpt" else deepspeed_program(args.root)
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
    result = stamp(args.name, printable, root=args.root)
    result.update({
        "bench_command": invocation(),
        "returncode": proc.returncode,
        "wall_s": round(time.time() - start, 1),
        "warmup_iters": args.warmup,
        "records": records,
        # what the launcher and the workers said they settled ('auto' resolved, placement)
        "settings": [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith(SETTINGS)],
    })
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
    path = write_result(args.out, result)
    print(f"wrote {path}: " + json.dumps({k: v for k, v in result.items() if k.endswith("median") or k.startswith("goal")
                                           or k.startswith("peak")}))
    return 0 if proc.returncode == 0 and steady else 1


if __name__ == "__main__":
    sys.exit(main())
