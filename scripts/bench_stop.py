"""A stop is a save, at a real size on one GPU: `angelgpt train` of a preset with asynchronous saves,
SIGTERM sent to every process of the job (twice, as Slurm and `kill -- -PGID` deliver it) while iteration
STOP_AT trains; then `--load` of what it saved, trained to ITERS; and the same run uninterrupted. One
result file: the stop's exit code, its one line, the checkpoint's iteration, and the resumed losses beside
the uninterrupted run's.

    python scripts/bench_stop.py --size 1.3b --iters 20 --stop-at 15 [-- KEY=VALUE ...]
"""

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.results import RESULTS, invocation, stamp, write_result  # noqa: E402


def train(args, metrics, *extra, signal_at=None):
    """Runs `angelgpt train`; with signal_at, SIGTERM twice to every process of the job once the metrics
    file holds iteration signal_at - 1 (iteration signal_at training). Returns (exit code, stderr, seconds)."""
    import psutil

    cmd = [sys.executable, "-m", "angelgpt", "train", "--size", args.size, "--metrics-file", str(metrics),
           "logging.log_interval=1", f"train.train_iters={args.iters}", *args.overrides, *extra]
    started = time.time()
    proc = subprocess.Popen(cmd, cwd=ROOT, text=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            env=dict(os.environ, PYTHONWARNINGS="ignore"))
    if signal_at is not None:
        while proc.poll() is None:
            if metrics.exists() and len(metrics.read_text().splitlines()) >= signal_at - 1:
                root = psutil.Process(proc.pid)
                for _ in range(2):
                    for p in [root, *root.children(recursive=True)]:
                        try:
                            p.send_signal(signal.SIGTERM)
                        except psutil.NoSuchProcess:
                            pass
                    time.sleep(0.2)
                break
            time.sleep(0.05)
    _, err = proc.communicate()
    return proc.returncode, err, round(time.time() - started, 1)


def losses(metrics):
    return {r["iteration"]: r["lm_loss"] for r in map(json.loads, Path(metrics).read_text().splitlines())}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="1.3b")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--stop-at", type=int, default=15)
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-stop-", dir=ROOT))
    ck = work / "ck"
    saves = [f"checkpoint.save={ck}", "checkpoint.save_interval=10", "checkpoint.async_save=true", "checkpoint.keep=1"]
    rc, err, stop_s = train(args, work / "first.jsonl", *saves, signal_at=args.stop_at)
    lines = [line for line in err.splitlines() if line.startswith("angelgpt:")]
    tracker = ck / "latest_checkpointed_iteration.txt"
    saved = int(tracker.read_text()) if tracker.exists() else None
    resumed_rc, resumed_err, resume_s = train(args, work / "resumed.jsonl", f"checkpoint.load={ck}")
    full_rc, full_err, full_s = train(args, work / "full.jsonl")
    resumed, full = losses(work / "resumed.jsonl"), losses(work / "full.jsonl")
    diffs = {it: abs(v - full[it]) / abs(full[it]) for it, v in resumed.items() if it in full}
    name = f"stop-{args.size}"
    result = stamp(name, "python scripts/bench_stop.py " + " ".join(sys.argv[1:]))
    result.update({
        "bench_command": invocation(), "signalled_during_iteration": args.stop_at, "saves": saves,
        "stop": {"returncode": rc, "lines": lines, "checkpoint_iteration": saved, "seconds": stop_s,
                 "stderr_tail": err[-1500:] if rc else ""},
        "resume": {"returncode": resumed_rc, "first_iteration": min(resumed) if resumed else None,
                   "losses": resumed, "seconds": resume_s, "stderr_tail": resumed_err[-1500:] if resumed_rc else ""},
        "uninterrupted": {"returncode": full_rc, "losses": full, "seconds": full_s,
                          "stderr_tail": full_err[-1500:] if full_rc else ""},
        "max_relative_loss_difference": max(diffs.values()) if diffs else None,
    })
    path = write_result(args.out, result)
    shutil.rmtree(work, ignore_errors=True)
    print(f"wrote {path}: " + json.dumps({"stop": result["stop"]["lines"], "saved": saved,
                                          "resumed_from": result["resume"]["first_iteration"],
                                          "max_rel_diff": result["max_relative_loss_difference"]}))
    return 0 if rc == 0 and resumed_rc == 0 and full_rc == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
