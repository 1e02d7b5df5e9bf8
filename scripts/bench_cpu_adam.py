"""Host update of one slice, as ZeRO-Cache's update thread does it: bf16 gradient in, fp32 AdamW,
bf16 weights out into a pinned upload buffer. Compares the one-pass kernel (zero_cache.cpu_adam=native)
with torch's fused AdamW and the two conversions around it ('torch'), and times the kernel on the compact
states too ('native-compact': the master as the bf16 weight, read and written in place, and an int16
remainder; bf16 moments: optim.store_param_remainders, optim.exp_avg_dtype and exp_avg_sq_dtype bf16;
'native-fp8': the same master, fp8 moments, exp_avg_dtype and exp_avg_sq_dtype fp8; 'torch-fp8': those
states through torch's codec and fused AdamW, as zero_cache.cpu_adam=torch updates them).

    python scripts/bench_cpu_adam.py [--numel 67108864] [--threads N] [--repeats 7] [--out benchmarks/results]

Writes <out>/cpu_adam-<numel>[-t<threads>].json (a run again -runN.json; benchmarks.results writes it): the
command, commit, machine, median seconds and G params/s of each path, and the largest difference between the
two paths' master weights (and between the compact kernel's decoded master and the native one's).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # angelgpt and the benchmarks package of this checkout


def main() -> int:
    import torch

    from angelgpt.zero_cache.cpu_adam import CpuAdam
    from benchmarks.results import RESULTS, invocation, stamp, write_result

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--numel", type=int, default=1 << 26, help="slice size (zero_cache.update_slice_numel)")
    ap.add_argument("--threads", type=int, default=None, help="both paths' threads (default: torch's)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()
    if args.numel <= 0 or args.repeats <= 0 or (args.threads is not None and args.threads <= 0):
        print("bench_cpu_adam: --numel, --threads and --repeats must be > 0", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    pin = torch.cuda.is_available()  # host chunks are pinned when a GPU takes their weights
    n = args.numel
    gen = torch.Generator().manual_seed(0)

    def buffers():
        states = torch.empty(3, n, pin_memory=pin)
        states[0].normal_(generator=gen)
        states[1].normal_(generator=gen).mul_(1e-3)
        states[2].uniform_(generator=gen).mul_(1e-6)
        return states

    states = {"native": buffers()}
    states["torch"] = states["native"].clone()
    from angelgpt.zero_cache.precision import join_master, split_master

    weights = torch.empty(n, dtype=torch.bfloat16, pin_memory=pin)  # the compact states, from the same start
    compact = [torch.empty(n, dtype=torch.int16), states["native"][1].to(torch.bfloat16),
               states["native"][2].to(torch.bfloat16)]
    split_master(states["native"][0], weights, compact[0])
    from angelgpt.zero_cache.placement import CODEC_SLICE, slices
    from angelgpt.zero_cache.precision import StateFormat, decode, encode, write_moment

    fp8 = StateFormat(True, "fp8", "fp8")
    fp8_rows = fp8.rows(torch.empty(fp8.nbytes(n), dtype=torch.uint8), n)
    fp8_weights = weights.clone()
    fp8_rows[0].copy_(compact[0])
    write_moment(states["native"][1], fp8_rows[1])
    write_moment(states["native"][2], fp8_rows[2], squared=True)
    grad = torch.empty(n, dtype=torch.bfloat16, pin_memory=pin).normal_(generator=gen).mul_(1e-3)
    out = torch.empty(n, dtype=torch.bfloat16, pin_memory=pin)
    scratch = torch.empty(n, pin_memory=pin)  # the torch path's fp32 gradient
    hyper = dict(lr=1e-4, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)
    kernel = CpuAdam.load("native")
    step_t = torch.zeros(())

    def native(step):
        kernel.step(states["native"], grad, out, step=step, coef=0.5, **hyper)

    def native_compact(step):
        kernel.step(compact, grad, None, step=step, coef=0.5, hi=weights, **hyper)

    def native_fp8(step):
        kernel.step(fp8_rows, grad, None, step=step, coef=0.5, hi=fp8_weights, seed=(0, step), **hyper)

    fp8_torch = fp8.rows(torch.empty(fp8.nbytes(n), dtype=torch.uint8), n)
    for dst, src in zip(fp8_torch, fp8_rows):
        dst.copy_(src)
    fp8_torch_weights = weights.clone()
    work = torch.empty(3, CODEC_SLICE)

    def torch_fp8(step):  # update.Update._adamw's torch path, a codec slice at a time
        for a, b in slices(n, CODEC_SLICE):
            rows, w = [r[a:b] for r in fp8_torch], work[:, :b - a]
            decode(fp8, rows, fp8_torch_weights[a:b], w)
            scratch[a:b].copy_(grad[a:b])
            step_t.fill_(step)
            torch._fused_adamw_([w[0]], [scratch[a:b]], [w[1]], [w[2]], [], [step_t], lr=hyper["lr"],
                                beta1=hyper["betas"][0], beta2=hyper["betas"][1],
                                weight_decay=hyper["weight_decay"], eps=hyper["eps"], amsgrad=False,
                                maximize=False, grad_scale=torch.tensor(2.0))
            encode(fp8, w, rows, fp8_torch_weights[a:b], seed=(0, step), base=a)

    def torch_path(step):
        st = states["torch"]
        scratch.copy_(grad)
        step_t.fill_(step)
        torch._fused_adamw_([st[0]], [scratch], [st[1]], [st[2]], [], [step_t], lr=hyper["lr"],
                            beta1=hyper["betas"][0], beta2=hyper["betas"][1], weight_decay=hyper["weight_decay"],
                            eps=hyper["eps"], amsgrad=False, maximize=False, grad_scale=torch.tensor(2.0))
        out.copy_(st[0])

    times = {"native": [], "torch": [], "native-compact": [], "native-fp8": [], "torch-fp8": []}
    for step in range(1, args.repeats + 2):  # the first round warms up (page faults, thread start)
        for name, fn in (("native", native), ("torch", torch_path), ("native-compact", native_compact),
                         ("native-fp8", native_fp8), ("torch-fp8", torch_fp8)):
            t0 = time.perf_counter()
            fn(step)
            if step > 1:
                times[name].append(time.perf_counter() - t0)
    diff = ((states["native"][0] - states["torch"][0]).abs().max() / states["torch"][0].abs().max()).item()
    result = stamp(f"cpu_adam-{n}" + (f"-t{args.threads}" if args.threads else ""), invocation())
    result.update({
        "numel": n, "threads": kernel.threads, "pinned": pin, "repeats": args.repeats,
        "median_s": {k: statistics.median(v) for k, v in times.items()},
        "gparams_per_s": {k: n / statistics.median(v) / 1e9 for k, v in times.items()},
        "speedup": statistics.median(times["torch"]) / statistics.median(times["native"]),
        "master_max_rel_diff": diff,
        "compact_speedup": statistics.median(times["native"]) / statistics.median(times["native-compact"]),
        "fp8_speedup": statistics.median(times["native"]) / statistics.median(times["native-fp8"]),
        "torch_fp8_speedup": statistics.median(times["native"]) / statistics.median(times["torch-fp8"]),
        "compact_master_max_rel_diff": ((join_master(weights, compact[0], torch.empty(n)) - states["native"][0]).abs()
                                        .max() / states["native"][0].abs().max()).item(),
    })
    print(f"wrote {write_result(args.out, result, indent=1)}")
    print(json.dumps({k: result[k] for k in ("median_s", "gparams_per_s", "speedup", "master_max_rel_diff",
                                                      "compact_speedup", "fp8_speedup", "torch_fp8_speedup",
                                                      "compact_master_max_rel_diff")}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
