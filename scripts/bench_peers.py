"""Side-by-side benchmark on one machine: largest trainable model and throughput of angelgpt's ZeRO-Cache
against Megatron's distributed optimizer, Megatron's CPU offload and DeepSpeed ZeRO-3 offload.

    # run cases (one result file each under benchmarks/results/; existing ones are skipped, so a sweep resumes)
    python scripts/bench_peers.py run megatron:9 zero_cache:20 zero_cache_nvme:23 --iters 3 --warmup 1
    python scripts/bench_peers.py run zero_cache:9 --iters 8 --warmup 3      # throughput at another size
    # BENCHMARKS.md and benchmarks/peers.png from the result files
    python scripts/bench_peers.py report

The GPT family is the 55 preset's layer shape (hidden 8192, 64 heads of 128, FFN 32768, vocabulary
50257, sequence 2048, full activation recompute, bf16, mock data) with a varying number of layers
(the `h200-16b` preset with model.num_layers=L). Every system may choose its own micro batch and
recompute (`model.recompute=none` keeps activations where GPU memory allows; such a case's file name
says so). A case is SYSTEM:LAYERS[:micro_batch[:global_batch[:overrides]]], the overrides
comma-separated KEY=VALUE pairs for that case alone (for example
`megatron_cpu_offload:13:2:32:optim.offload_fraction=0.7`).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(os.environ.get("ANGELGPT_BENCH_OUT", ROOT / "benchmarks" / "results"))
NVME_DIR = os.environ.get("ANGELGPT_BENCH_NVME", "/tmp/angelgpt-nvme")
SYSTEMS = {
    "megatron": ["optim.optimizer=megatron"],
    "megatron_cpu_offload": ["optim.optimizer=megatron_cpu_offload", "optim.offload_fraction=1.0"],
    "deepspeed_zero3_offload": [],  # scripts/bench_deepspeed.py, with the `bench` extra (DeepSpeed)
    "zero_cache": ["optim.optimizer=zero_cache", "zero_cache.prefetch_cache_sub_group_rate=auto"],
    "zero_cache_nvme": ["optim.optimizer=zero_cache", "zero_cache.prefetch_cache_sub_group_rate=auto",
                        f"zero_cache.nvme_path={NVME_DIR}"],
}
LABEL = {"megatron": "(a) Megatron distributed optimizer", "megatron_cpu_offload": "(b) Megatron CPU offload",
         "deepspeed_zero3_offload": "(c) DeepSpeed ZeRO-3 offload", "zero_cache": "(d) ZeRO-Cache GPU+CPU",
         "zero_cache_nvme": "(e) ZeRO-Cache GPU+CPU+NVMe"}


def parse_case(text: str):
    parts = text.split(":", 4)
    extra = parts[4].split(",") if len(parts) == 5 else []
    numbers = parts[1:4]
    if (parts[0] not in SYSTEMS or not 2 <= len(parts) <= 5 or not all(p.isdigit() and int(p) > 0 for p in numbers)
            or not all("=" in kv for kv in extra)):
        print(f"bench_peers: bad case '{text}': SYSTEM:LAYERS[:MICRO[:GLOBAL[:KEY=VALUE,...]]] with SYSTEM one of "
              f"{', '.join(SYSTEMS)} and positive numbers", file=sys.stderr)
        raise SystemExit(2)
    layers, mb, gb = int(parts[1]), int(parts[2]) if len(parts) > 2 else 4, int(parts[3]) if len(parts) > 3 else 32
    return parts[0], layers, mb, gb, extra


CASE_KEYS = {"model.recompute": "recompute", "zero_cache.prefetch_cache_sub_group_rate": "rate",
             "zero_cache.device_update_fraction": "devupdate", "zero_cache.cpu_adam": "cpuadam"}


def run(args) -> int:
    failed = 0
    for text in args.cases:
        system, layers, mb, gb, case_extra = parse_case(text)
        name = f"peers-{system}-L{layers}-mb{mb}-gb{gb}"
        # the preset recomputes every layer, and the planner places the states and splits the host update:
        # another choice is another case
        for key, label in CASE_KEYS.items():
            values = [kv.split("=", 1)[1] for kv in case_extra if kv.startswith(key + "=")]
            if values:
                name += f"-{label}{values[-1]}"
        if (RESULTS / f"{name}.json").exists() and not args.force:
            print(f"{name}: result exists, skipped", flush=True)
            continue
        runner = "deepspeed" if system == "deepspeed_zero3_offload" else "angelgpt"
        if runner == "deepspeed" and importlib.util.find_spec("deepspeed") is None:
            print(f"{name}: DeepSpeed is not installed here (pip install angelgpt[bench]); not run", flush=True)
            continue
        cmd = [sys.executable, str(ROOT / "scripts" / "bench_train.py"), "--runner", runner, "--name", name,
               "--size", "h200-16b",
               "--iters", str(args.iters), "--warmup", str(args.warmup), "--out", str(RESULTS), "--",
               f"model.num_layers={layers}", f"train.micro_batch_size={mb}", f"train.global_batch_size={gb}",
               "optim.lr_warmup_iters=1", *SYSTEMS[system], *case_extra, *args.extra]
        print("case:", " ".join(cmd[2:]), flush=True)
        failed += subprocess.call(cmd, cwd=ROOT) != 0
    return 0 if not failed else 1


def newest_runs(files):
    """(path, result) of the newest run of each case: a case run again writes NAME-runN.json beside
    NAME.json (scripts/bench_train.py never overwrites), and the report takes the latest by date."""
    newest = {}
    for f in files:
        r = json.loads(f.read_text())
        case = re.sub(r"-run\d+$", "", f.stem)
        if case not in newest or r.get("date", "") >= newest[case][1].get("date", ""):
            newest[case] = (f, r)
    return sorted(newest.values(), key=lambda fr: fr[0].name)


def load_results():
    out = []
    for f, r in newest_runs(sorted(RESULTS.glob("peers-*.json"))):
        system, rest = r["name"][len("peers-"):].rsplit("-L", 1)
        layers = int(rest.split("-")[0])
        steps = len(r.get("records", []))
        profiles = [x["zero_cache_profile"] for x in r.get("records", [])[r.get("warmup_iters", 0):]
                    if x.get("zero_cache_profile")]
        profile = {k: statistics.median(p[k] for p in profiles) for k in profiles[0]} if profiles else None
        mb, gb = (int(x[2:]) for x in rest.split("-")[1:3])
        out.append(dict(file=f.name, system=system, layers=layers, ok=r["returncode"] == 0 and steps >= 3,
                        params=None, tflops=r.get("tflops_per_gpu_median"), tokens=r.get("tokens_per_s_median"),
                        gpu=r.get("peak_gpu_gib"), host=r.get("peak_host_gib"), oom=r.get("oom"),
                        oom_kind=r.get("oom_kind"), refused=r.get("refused"),
                        commit=r.get("commit", "")[:10], steps=steps, mb=mb, gb=gb, profile=profile,
                        step_ms=r.get("elapsed_ms_median"), settings=settings(r.get("command", ""))))
    return out


NOTABLE = ("model.recompute", "zero_cache.prefetch_cache_sub_group_rate", "optim.offload_fraction", "zero_cache.accumulate_in_store",
           "zero_cache.offload_params", "zero_cache.device_update_fraction", "zero_cache.nvme_path", "zero_cache.cpu_adam")


def settings(command: str) -> str:
    """The notable overrides a run used (the last value of each key), for the tables."""
    found = {}
    for word in command.split():
        key, _, value = word.partition("=")
        if key in NOTABLE:
            found[key.split(".")[-1]] = value
        elif key.startswith("deepspeed."):  # scripts/bench_deepspeed.py's own keys
            found[key.removeprefix("deepspeed.").removeprefix("zero_optimization.")] = value
    return ", ".join(f"{k}={v}" for k, v in found.items()) or "-"


def outcome(r) -> str:
    """Why a run completed no step, for the runs table: out of memory, or refused by the planner."""
    if r["refused"]:
        return f" (refused: {r['refused']})"
    return f" (OOM: {r['oom_kind'] or 'gpu'})" if r["oom"] else ""


def report(args) -> int:
    from angelgpt.config import resolve
    from angelgpt.model.flops import num_params

    rows = load_results()
    for r in rows:
        r["params"] = num_params(resolve("h200-16b", overrides=[f"model.num_layers={r['layers']}"]))
    best = {}
    for r in rows:
        if r["ok"] and (r["system"] not in best or r["layers"] > best[r["system"]]["layers"]):
            best[r["system"]] = r
    lines = ["# Benchmarks: one H200, the 55 preset's layer shape with varying layers", "",
             "Every figure below is read from a result file under `benchmarks/results/` (written by "
             "`scripts/bench_peers.py run`, which records the exact command, commit and machine); this file "
             "and `benchmarks/peers.png` are regenerated by `python scripts/bench_peers.py report`.", "",
             "## Runs", "", "| system | layers | params | micro / global batch | settings | completed steps | "
             "model TFLOP/s/GPU | tokens/s | peak GPU GiB | peak host GiB | result file |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["system"], r["layers"], r["gb"])):
        fmt = lambda v, f: (f.format(v) if v is not None else "-")  # noqa: E731
        lines.append(f"| {LABEL.get(r['system'], r['system'])} | {r['layers']} | {r['params'] / 1e9:.2f}B | "
                     f"{r['mb']} / {r['gb']} | {r['settings']} | "
                     f"{r['steps']}{outcome(r)} | {fmt(r['tflops'], '{:.1f}')} | "
                     f"{fmt(r['tokens'], '{:,.0f}')} | {fmt(r['gpu'], '{:.1f}')} | {fmt(r['host'], '{:.1f}')} | "
                     f"`{r['file']}` |")
    lines += ["", "## Largest model that completes 3 optimizer steps", "",
              "| system | layers | params | the next size up |", "|---|---|---|---|"]
    for system in SYSTEMS:
        b = best.get(system)
        if not b:
            lines.append(f"| {LABEL[system]} | not run | - | - |")
            continue
        bigger = [r for r in rows if r["system"] == system and r["layers"] > b["layers"]]
        nxt = min(bigger, key=lambda r: r["layers"]) if bigger else None
        ended = (f"were refused before launch, {nxt['refused']}" if nxt and nxt["refused"]
                 else f"ran out of {nxt['oom_kind'] or 'GPU'} memory" if nxt else "")
        why = (f"{nxt['layers']} layers {ended} (micro batch {nxt['mb']}"
               f"{', ' + nxt['settings'] if nxt['settings'] != '-' else ''})" if nxt and nxt["oom"]
               else "not tried: the largest size is not established")
        lines.append(f"| {LABEL[system]} | {b['layers']} | {b['params'] / 1e9:.2f}B | {why} |")
    goals = []

    def ratio(a, b, goal, what):
        if a and b:
            value = a / b
            goals.append(f"| {what} | {goal:.2f}x | {value:.2f}x | {'met' if value >= goal else 'missed'} |")
        else:
            goals.append(f"| {what} | {goal:.2f}x | not measured | - |")

    d, a, c, bsys, e = (best.get(k) for k in ("zero_cache", "megatron", "deepspeed_zero3_offload",
                                               "megatron_cpu_offload", "zero_cache_nvme"))
    ratio(d and d["params"], a and a["params"], 2.0, "size: (d) / (a)")
    ratio(d and d["params"], c and c["params"], 1.9, "size: (d) / (c)")
    ratio(d and d["params"], 16e9, 1.0, "size: (d) / 16B")
    ratio(e and e["params"], 19e9, 1.0, "size: (e) / 19B")

    def at(system, layers):
        hits = [r for r in rows if r["system"] == system and r["layers"] == layers and r["ok"] and r["tflops"]]
        return max((r["tflops"] for r in hits), default=None)

    for peer, goal in (("megatron", 0.97), ("deepspeed_zero3_offload", 2.0), ("megatron_cpu_offload", 1.2)):
        p = best.get(peer)
        ratio(p and at("zero_cache", p["layers"]), p and at(peer, p["layers"]), goal,
              f"speed: (d) / {LABEL[peer][:3]} at {LABEL[peer][:3]}'s largest measured size"
              + (f" ({p['layers']} layers)" if p else ""))
    ratio(d and at("zero_cache", d["layers"]), a and at("megatron", a["layers"]), 0.75,
          "speed: (d) at its largest / (a) at its largest" + (f" ({d['layers']} layers, global batch {d['gb']})"
                                                              if d else ""))
    # at the throughput comparison's global batch, (d)'s largest size may be smaller
    same = [r for r in rows if r["system"] == "zero_cache" and r["ok"] and a and r["gb"] == a["gb"]]
    d_gb = max(same, key=lambda r: r["layers"], default=None)
    if a:
        if d_gb and (not d or d_gb["layers"] != d["layers"]):
            ratio(at("zero_cache", d_gb["layers"]), at("megatron", a["layers"]), 0.75,
                  f"speed: (d) at its largest at global batch {a['gb']} ({d_gb['layers']} layers) / (a) at its "
                  "largest")
    lines += ["", "## Goals", "", "| goal | target | measured | |", "|---|---|---|---|", *goals, ""]
    profiled = [r for r in rows if r["profile"]]
    if profiled:
        lines += ["## ZeRO-Cache time profile (median per step after warm-up, `is_communication_time_profiling`)",
                  "", "| layers | micro / global batch | commit | step ms | D2H ms (GB) | weight fetch ms (GB) | "
                  "in-store accumulation round trips ms (GB) | host states updated by the CPU ms (of it AdamW) | "
                  "host states updated on the GPU ms (GB over PCIe) | exposed: waiting for the update ms | "
                  "waiting for a fetch ms | waiting for an accumulation slot ms |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in sorted(profiled, key=lambda r: (r["layers"], r["gb"])):
            p = r["profile"]
            lines.append(f"| {r['layers']} | {r['mb']} / {r['gb']} | {r['commit'][:7]} | {r['step_ms']:.0f} | "
                         f"{p['d2h_ms']:.0f} ({p.get('d2h_gb', 0):.1f}) | "
                         f"{p['fetch_ms']:.0f} ({p.get('fetch_gb', 0):.1f}) | "
                         f"{p.get('accumulate_ms', 0):.0f} ({p.get('accumulate_gb', 0):.1f}) | "
                         f"{p['update_thread_ms']:.0f} ({p['cpu_optimizer_ms']:.0f}) | "
                         f"{p.get('device_update_thread_ms', 0):.0f} ({p.get('device_update_gb', 0):.1f}) | "
                         f"{p['exposed_wait_update_ms']:.0f} | {p['exposed_wait_fetch_ms']:.0f} | "
                         f"{p.get('exposed_wait_slot_ms', 0):.0f} |")
        lines.append("")
    lines += ["## Notes", "",
              "- (c) DeepSpeed ZeRO-3 offload (`scripts/bench_deepspeed.py`, DeepSpeed 0.19.8, its CPU Adam "
              "built on the machine at first use) trains a plain PyTorch GPT of the same shapes, parameter count "
              "(tested against Megatron's GPTModel), initial scale and FLOP count, with parameters and optimizer "
              "states offloaded to CPU and DeepSpeed's default buckets and prefetch. With pinned host memory "
              "(DeepSpeed's default) it fits 5 layers (283.0 TFLOP/s, 121.7 GiB host); at 6 layers its start-up "
              "alone took 106.3 GiB of host memory and the out-of-memory killer stopped it in the first step "
              "(`deepspeed-L6-pinned-host-oom.json`; 7 and 8 layers likewise: `deepspeed-L7-pinned-host-oom.json`, "
              "`deepspeed-L8-pinned-host-oom.json`). With pageable host memory (`pin_memory: false`) its whole "
              "6-layer run peaked at 105.9 GiB, and it fits 7 layers, at 121.6 TFLOP/s with full recompute and "
              "126.6 without (40.6 GiB GPU, 119.4 GiB host): the parameters cross PCIe from pageable memory "
              "every micro batch, so recomputing costs it little. Against ZeRO-Cache at 6 layers (456.8) its "
              "6-layer pageable run reached 125.1.",
              "- Recompute: every system may pick its micro batch and `model.recompute` (the preset recomputes "
              "every layer). Where GPU memory allows, no recompute is faster for all of them: at 7 layers (a) "
              "made 556.4 TFLOP/s (micro batch 2; 446.1 with recompute) and (d) 584.4; at 11 layers (b) made "
              "458.6 (micro batch 1, offload fraction 0.5; 388.4 with recompute) and (d) 558.1. The speed "
              "ratios take each system's fastest run at a size.",
              "- (d)/(b) at 11 layers needs 550 TFLOP/s (a 6.75 s step). The host update starts once backward "
              "has given the global norm (clipping needs it) and the next micro batch reaches the host layers "
              "about 60 ms into its forward, so what shortens the wait is fewer host-resident parameters. Up to "
              "commit 37526ee the caching allocator reserved 18.3 GiB over what was allocated (137.6 of 139.8 "
              "GiB at rate 0.75): every released gradient was marked with the D2H stream, so the gradients of "
              "device-resident layers, added up on the compute stream, stayed held until that stream's queued "
              "round trips had passed; rates above 0.75 retried allocations 24 times a step (506.9 TFLOP/s at "
              "0.78, `peers-zero_cache-L11-mb1-gb32-recomputenone-rate0.78.json`; 476.6 at 0.81, "
              "`zero_cache-L11-rate0.81-allocator-retries.json`), and the best was 540.6 (1.18x, rate 0.75, "
              "CPU AdamW `native`, commit c295635). A gradient is now held only by the stream that reads it: at "
              "rate 0.75, 124.7 GiB reserved (536b499, 529.6 TFLOP/s on a slower machine of the kind); at 0.79 "
              "131.9 GiB and no retries (542.6 on that machine, `-rate0.79`). With the planner's room for the "
              "transfer streams cut from six layers' gradients to two, `auto` takes that placement (rate 0.81, "
              "1.9B host parameters instead of 2.4B). With each host chunk's running sum brought up to its "
              "device slot while the layer's backward runs (only the add waits for the new gradients; commit "
              "e9390a2) and 45% of the host states updated on the GPU it made 558.1 (1.22x, `-devupdate0.45`). "
              "With the planner's split taken from the rates measured in training (42% on the GPU, commit "
              "0d25b90; it had been 56%) `auto` made 552.5 on another machine of the kind (1.20x), the CPU and "
              "the GPU taking 0.33 and 0.34 s and the step waiting 0.20 s for them.",
              "- (d) at its largest sizes: the activations fit only with recompute. With "
              "`model.recompute=auto` the planner keeps the last 5 of 19 layers' activations (Megatron's "
              "`block` recompute of the first 14), paying for them with states moved to the host (rate "
              "0.42): 395.7 TFLOP/s against 385.2 recomputing every layer with the same code (rate 0.44) and "
              "393.6 at commit ef6f814 (rate 0.46, one chunk per layer), so 0.73x of the 545.1 (a) had made "
              "then (the earlier version of its result file; goal "
              "0.75x). The planner expected 14.4 s, the run took 15.9 s: the layers that keep their "
              "activations are the host-resident ones, whose shorter backward now leaves less time for their "
              "gradients' round trips over PCIe, and the wait for the host update stays about 2.0 s. With the "
              "one-pass CPU AdamW the wait fell to 1.6-1.8 s: 401.6 TFLOP/s with 61% of the host states updated "
              "on the GPU (`peers-zero_cache-L19-mb2-gb32-recomputeauto-split0.61.json`, commit db6b14e), 393.8 "
              "with 45% (`-devupdate0.45`), so 0.74x. With gradients held only by the stream that reads them "
              "(commit 536b499) the allocator retried 0-1 times a step instead of about 11: 401.0 at rate 0.44 "
              "(8.86B host parameters). Each accumulation round trip then still waited for the layer's new "
              "gradients before its running sum started up over PCIe (29 ms for a layer's 1.6 GB, longer than "
              "the backward of a layer that keeps its activations), and the next round trips queued behind it; "
              "with the sum brought up while the layer's backward runs and only the add waiting for the gradients "
              "(commit e9390a2), it made 422.4 TFLOP/s on one machine (a 14.9 s step, 1.73-1.82 s of it the "
              "wait for the host update; that result file is in the history of "
              "`peers-zero_cache-L19-mb2-gb32-recomputeauto.json`). Measured again beside (a) on one machine "
              "(commit aaf33cb; that machine's memory gave rate 0.44, 8.86B host parameters): (a) 556.4, and "
              "(d) 414.3 with the planner's split then (56% of the host states updated on the GPU, `-split0.56`) "
              "and 421.0 with 45% (`-devupdate0.45`): 0.76x. In both the GPU path was the longer (1.86 and "
              "1.69 s against the CPU's 1.20 and 1.34 s): the CPU ran 3.4-3.8 G params/s beside it, not the "
              "2.04 the planner assumed. With the planner's split from those rates (42%, commit 0d25b90) the "
              "two took 1.61 and 1.46 s and the wait was 1.48 s: 418.4 TFLOP/s at rate 0.42 on another machine "
              "(`peers-zero_cache-L19-mb2-gb32-recomputeauto.json`). The host update moves 28 bytes a parameter "
              "through host memory on the CPU and 26 over PCIe: 124-150 GB/s together, the most when both "
              "paths finish together.",
              "- (e) ZeRO-Cache with the NVMe tier: 24 layers (19.76B) at rate 0.40 (`auto`) completed 3 "
              "steps at global batch 2: 63 GiB of states on the disk, 114.6 GiB host and 122.1 GiB GPU at "
              "peak, 67.6 s per step, 7.3 TFLOP/s. The step is the NVMe tier's: 135.3 GB read and written per "
              "step, and the next forward waits 64-68 s for the update. 23 layers are 18.95B, so the goal "
              "needs 24. Its first attempt stopped on a short read: Linux moves at most 2 GiB per read or "
              "write call, and a 9.7 GB chunk had been written short (fixed in 6ef7912).",
              "- Losses: runs before commit d0edda7 on the GPU logged the loss divided by the number of micro "
              "batches (Megatron's schedule scales the loss it back-propagates in place, and the logged value "
              "shared its storage); gradients, throughput and memory were not affected.",
              "- (b) Megatron CPU offload: 11 layers ran at offload fraction 0.5. At 12 layers it ran out of GPU "
              "memory at fractions 0.5 and 0.6 (`megatron_cpu_offload-L12-fraction0.5-gpu-oom.json`, and the "
              "run in the table) while creating its GPU Adam states, and the kernel's out-of-memory killer "
              "stopped it at 0.7 (`megatron_cpu_offload-L12-fraction0.7-host-oom.json`), as it did 8 layers at "
              "1.0 (`megatron_cpu_offload-L8-fraction1.0-host-oom.json`); higher fractions need more host "
              "memory than 0.7, so 11 layers is its largest size here.",
              "- (d) runs before commit 4e6d409 (7 and 13 layers) used one CUDA hardware queue "
              "(CUDA_DEVICE_MAX_CONNECTIONS=1, Megatron's setting, which the launcher now keeps for Megatron's "
              "optimizers only): every wait of ZeRO-Cache's transfer streams then held up the compute kernels "
              "queued behind it. The same runs with one queue are kept: 19 layers at global batch 32 "
              "(`device-update-L19-one-hardware-queue.json`, 317.6 TFLOP/s, against 393.6 with several), 11 "
              "layers (`device-update-L11-one-hardware-queue.json`, 388.6 against 431.1) and 12 layers "
              "(`device-update-L12-one-hardware-queue.json`, 381.5 against 430.9).",
              "- (d) at 20 layers ran one micro batch per step (global batch 2): the host layers' weights are "
              "offloaded then, so their states are updated by the CPU (device updates write weights in place "
              "on the GPU), and the wait for that update is 3.7 s of the 4.7 s step (82.9 TFLOP/s with one "
              "hardware queue before device updates: `zero_cache-L20-gb2-one-hardware-queue.json`). At global "
              "batch 32, 19 layers "
              "is the largest size the planner fits: the micro batches' gradients accumulate in the store "
              "(`zero_cache.accumulate_in_store`), each host chunk's running sum going up to a device slot, "
              "getting the new gradients added and coming back down, and a share of the host-resident states "
              "is updated on the GPU (`zero_cache.device_update_fraction: auto`: 56-64% in runs before commit "
              "0d25b90, 42% since) while the CPU updates the rest. 20 layers at global batch 32 were refused before launch: with that machine's memory "
              "the planner's closest placement was short of 4.3 GiB GPU and 1.8 GiB host memory (micro batch "
              "2), of 2.2 and 1.8 GiB at micro batch 1 (`peers-zero_cache-L20-mb2-gb32.json`, "
              "`-mb1-gb32`). Accumulating in the store needs every parameter's bf16 weight and gradient and "
              "fp32 master weight and moments, 16 bytes: 246 GiB at 16.54B, against 139.8 GiB of GPU and "
              "125 GiB of host memory that must also hold activations, workspace, gradients in flight, the "
              "accumulation slots and the process. Earlier versions of that run: every host state updated by the CPU "
              "(`accumulate-L19-cpu-update.json`, 285.4 TFLOP/s), the sums added by the CPU "
              "(`accumulate-L19-host-add.json`, 243.0), the weights of host layers offloaded too "
              "(`accumulate-L19-offloaded-weights.json`, 244.9), device updates with two accumulation slots "
              "(`device-update-L19-two-slots.json`, 316.3); and 12 layers with offloaded weights fetched every "
              "micro batch (`zero_cache-L12-fetched-weights.json`, 369.9). What stays exposed at 19 layers is "
              "the wait for the host update (1.5-1.8 s of a 14.9-15.2 s step; about 2.0 s before the one-pass CPU "
              "AdamW).",
              "- The profile's round-trip time runs from when a round trip is queued on the H2D stream, so it "
              "includes that stream's wait for the gradients of the layer still in backward; it is not PCIe "
              "time. The slot wait is the backward thread's wait on the CPU, not idle GPU time.", ""]
    (ROOT / "BENCHMARKS.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no chart (pip install angelgpt[bench])")
        return 0
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    names = [s for s in SYSTEMS if s in best]
    ax1.bar([LABEL[s][:3] for s in names], [best[s]["params"] / 1e9 for s in names], color="tab:blue")
    ax1.set_ylabel("largest model (B parameters)")
    ax1.set_title("Largest size measured to complete 3 steps, one H200")
    sizes = sorted({best[s]["layers"] for s in names} | ({d_gb["layers"]} if d_gb else set()))
    width = 0.8 / max(1, len(names))
    for i, s in enumerate(names):
        ax2.bar([j + i * width for j in range(len(sizes))], [at(s, L) or 0 for L in sizes], width, label=LABEL[s])
    ax2.set_xticks([j + width * (len(names) - 1) / 2 for j in range(len(sizes))])
    ax2.set_xticklabels([f"{L} layers" for L in sizes])
    ax2.set_ylabel("model TFLOP/s per GPU")
    ax2.set_title("Throughput at each system's largest size")
    ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(ROOT / "benchmarks" / "peers.png", dpi=110)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("cases", nargs="+")
    r.add_argument("--iters", type=int, default=8)
    r.add_argument("--warmup", type=int, default=3)
    r.add_argument("--force", action="store_true", help="run again even when the result file exists")
    r.add_argument("--extra", nargs="*", default=[], help="more KEY=VALUE overrides for every case")
    sub.add_parser("report")
    args = ap.parse_args()
    return run(args) if args.cmd == "run" else report(args)


if __name__ == "__main__":
    sys.exit(main())
