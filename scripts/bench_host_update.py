"""ZeRO-Cache's CPU update path alone, by slice size: per slice the bf16 gradient into an fp32 scratch,
fused CPU AdamW on the fp32 states, the new master into a pinned bf16 buffer, and its upload to the GPU
(double buffered), as `_update_off_device` runs it. Optionally beside it, traffic like the device
update's (fp32 states up and back down through pinned memory on two streams), which shares host
memory bandwidth and PCIe with it.

    python scripts/bench_host_update.py --params 2e9 --slices 26,24,23,22 --device-traffic \
        --out benchmarks/results/host-update-slices.json
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_train import commit, machine  # noqa: E402


def device_traffic(stop: threading.Event, moved: list) -> None:
    """Pinned fp32 slices up and down, as the device update streams states (32M elements a slice)."""
    n = 1 << 25
    host = torch.empty(3 * n, dtype=torch.float32, pin_memory=True)
    dev = torch.empty(3 * n, dtype=torch.float32, device="cuda")
    up, down = torch.cuda.Stream(), torch.cuda.Stream()
    while not stop.is_set():
        with torch.cuda.stream(up):
            dev.copy_(host, non_blocking=True)
        down.wait_stream(up)
        with torch.cuda.stream(down):
            host.copy_(dev, non_blocking=True)
        down.synchronize()
        moved[0] += 2 * host.numel() * 4


def cpu_update(states, grad, scratch, staging, weights, step, slice_elems: int) -> float:
    """One pass of the CPU path over every parameter; returns seconds."""
    upload = torch.cuda.Stream()
    done = [None, None]
    t0 = time.perf_counter()
    k = 0
    for lo in range(0, grad.numel(), slice_elems):
        hi = min(grad.numel(), lo + slice_elems)
        g = scratch[:hi - lo]
        g.copy_(grad[lo:hi])
        torch._fused_adamw_([states[0, lo:hi]], [g], [states[1, lo:hi]], [states[2, lo:hi]], [], [step],
                            lr=1e-4, beta1=0.9, beta2=0.95, weight_decay=0.1, eps=1e-8, amsgrad=False,
                            maximize=False)
        k = 1 - k
        if done[k] is not None:
            done[k].synchronize()
        buf = staging[k][:hi - lo]
        buf.copy_(states[0, lo:hi])
        with torch.cuda.stream(upload):
            weights[lo:hi].copy_(buf, non_blocking=True)
            done[k] = upload.record_event()
    upload.synchronize()
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=float, default=2e9)
    ap.add_argument("--slices", default="26,24,23,22", help="log2 of the slice sizes to try")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device-traffic", action="store_true")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    n = int(args.params)
    states = torch.randn(3, n).abs_()
    grad = torch.randn(n, dtype=torch.bfloat16).pin_memory()
    weights = torch.empty(n, dtype=torch.bfloat16, device="cuda")
    step = torch.zeros(())
    results = []
    for log2 in (int(x) for x in args.slices.split(",")):
        size = 1 << log2
        scratch = torch.empty(size, dtype=torch.float32)
        staging = [torch.empty(size, dtype=torch.bfloat16, pin_memory=True) for _ in range(2)]
        stop, moved = threading.Event(), [0]
        side = threading.Thread(target=device_traffic, args=(stop, moved)) if args.device_traffic else None
        if side:
            side.start()
        cpu_update(states, grad, scratch, staging, weights, step, size)  # warm-up
        t0, moved[0] = time.perf_counter(), 0
        times = [cpu_update(states, grad, scratch, staging, weights, step, size) for _ in range(args.repeats)]
        wall = time.perf_counter() - t0
        stop.set()
        if side:
            side.join()
        best = min(times)
        row = {"slice": size, "seconds": [round(t, 3) for t in times], "gparams_per_s": round(n / best / 1e9, 3),
               "device_traffic_gbs": round(moved[0] / wall / 1e9, 1) if side else None}
        print(json.dumps(row), flush=True)
        results.append(row)
    out = {"name": Path(args.out).stem, "command": "python " + " ".join(sys.argv), "commit": commit(),
           "machine": machine(), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "params": n, "threads": torch.get_num_threads(), "results": results}
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
