"""Side-by-side benchmark on one machine: largest trainable model and throughput of angelgpt's ZeRO-Cache
against Megatron's distributed optimizer, Megatron's CPU offload and DeepSpeed ZeRO-3 offload.

    # run cases (one result file each under benchmarks/results/; existing ones are skipped, so a sweep resumes)
    python scripts/bench_peers.py run megatron:9 zero_cache:20 zero_cache_nvme:23 --iters 3 --warmup 1
    python scripts/bench_peers.py run zero_cache:9 --iters 8 --warmup 3      # throughput at another size
    # BENCHMARKS.md and benchmarks/peers.png from the result files (benchmarks/report.py)
    python scripts/bench_peers.py report

(`python -m benchmarks.peers ...` is the same.) Every case of one `run` records the same device call
(`call` in its result file): ANGELGPT_BENCH_CALL when the calling shell set it (once per device call,
as scripts/goal_table.sh does), else the machine's hostname and boot id; the report takes a goal ratio
only from two files of one call.

The GPT family is the 55 preset's layer shape (hidden 8192, 64 heads of 128, FFN 32768, vocabulary
50257, sequence 2048, full activation recompute, bf16, mock data) with a varying number of layers
(the `h200-16b` preset with model.num_layers=L). Every system (benchmarks/systems.py) may choose its own
micro batch and recompute (`model.recompute=none` keeps activations where GPU memory allows; such a
case's file name says so). A case is SYSTEM:LAYERS[:micro_batch[:global_batch[:overrides]]], the
overrides comma-separated KEY=VALUE pairs for that case alone (for example
`megatron_cpu_offload:13:2:32:optim.offload_fraction=0.7`).

`--family llama` runs the Llama family instead: the `llama3-8b` preset's layer shape (hidden 4096, 32
query heads sharing 8 key/value heads, SwiGLU 14336, RMSNorm, RoPE, untied output over 128256 tokens)
at sequence 4096 with a varying number of layers (32 is Llama-3-8B itself); its files are named
llama-SYSTEM-Llayers-... and BENCHMARKS.md reports them in a table of their own.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

from benchmarks.results import ROOT, call_id
from benchmarks.systems import SYSTEMS

RESULTS = Path(os.environ.get("ANGELGPT_BENCH_OUT", ROOT / "benchmarks" / "results"))


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


CASE_KEYS = {"model.recompute": "recompute", "model.num_attention_heads": "heads",
             "zero_cache.prefetch_cache_sub_group_rate": "rate", "zero_cache.device_update_fraction": "devupdate", "zero_cache.cpu_adam": "cpuadam",
             "optim.store_param_remainders": "remainders", "optim.exp_avg_dtype": "expavg",
             "optim.exp_avg_sq_dtype": "expavgsq", "optim.accumulate_grads_in_fp32": "fp32sums"}


# family: (the preset, what every case of the family overrides, the result files' name prefix)
FAMILIES = {"gpt": ("h200-16b", [], "peers"),
            "llama": ("llama3-8b", ["model.seq_length=4096"], "llama")}


def case_name(system: str, layers: int, mb: int, gb: int, case_extra, prefix: str = "peers") -> str:
    """peers-SYSTEM-Llayers-mbM-gbG, then -recomputeX, -rateX, ... for what the case's overrides changed:
    the preset recomputes every layer, and the planner places the states and splits the host update,
    so another choice is another case."""
    name = f"{prefix}-{system}-L{layers}-mb{mb}-gb{gb}"
    for key, label in CASE_KEYS.items():
        values = [kv.split("=", 1)[1] for kv in case_extra if kv.startswith(key + "=")]
        if values:
            name += f"-{label}{values[-1]}"
    return name


def run(args) -> int:
    os.environ["ANGELGPT_BENCH_CALL"] = call_id()  # one call for every case below, whoever set it
    print(f"device call: {os.environ['ANGELGPT_BENCH_CALL']}", flush=True)
    failed = 0
    size, family_extra, prefix = FAMILIES[args.family]
    for text in args.cases:
        system, layers, mb, gb, case_extra = parse_case(text)
        name = case_name(system, layers, mb, gb, case_extra, prefix)
        if (RESULTS / f"{name}.json").exists() and not args.force:
            print(f"{name}: result exists, skipped", flush=True)
            continue
        runner = "deepspeed" if system.startswith("deepspeed_") else "angelgpt"
        if runner == "deepspeed" and importlib.util.find_spec("deepspeed") is None:
            print(f"{name}: DeepSpeed is not installed here (pip install angelgpt[bench]); not run", flush=True)
            continue
        cmd = [sys.executable, "-m", "benchmarks.train", "--runner", runner, "--name", name,
               "--size", size,
               "--iters", str(args.iters), "--warmup", str(args.warmup), "--out", str(RESULTS),
               "--root", str(Path(args.root).resolve()),
               "--",
               f"model.num_layers={layers}", f"train.micro_batch_size={mb}", f"train.global_batch_size={gb}",
               "optim.lr_warmup_iters=1", *family_extra, *SYSTEMS[system], *case_extra, *args.extra]
        print("case:", " ".join(cmd[3:]), flush=True)
        failed += subprocess.call(cmd, cwd=ROOT) != 0
    return 0 if not failed else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("cases", nargs="+")
    r.add_argument("--iters", type=int, default=8)
    r.add_argument("--warmup", type=int, default=3)
    r.add_argument("--family", choices=sorted(FAMILIES), default="gpt",
                   help="the layer shape the cases vary the depth of (the module's docstring)")
    r.add_argument("--force", action="store_true", help="run again even when the result file exists")
    r.add_argument("--extra", nargs="*", default=[], help="more KEY=VALUE overrides for every case")
    r.add_argument("--root", default=str(ROOT),
                   help="the angelgpt tree to train (a `git archive` of a commit, its sha in TREE/.commit)")
    rep = sub.add_parser("report", help="BENCHMARKS.md and benchmarks/peers.png from the result files")
    rep.add_argument("--results", default=str(RESULTS), help="the result files' directory")
    rep.add_argument("--out-dir", default=str(ROOT), help="where BENCHMARKS.md (and benchmarks/peers.png) go")
    rep.add_argument("--no-chart", action="store_true")
    args = ap.parse_args(argv)
    if args.cmd == "run":
        return run(args)
    from benchmarks.report import report

    return report(Path(args.results), Path(args.out_dir), with_chart=not args.no_chart)


if __name__ == "__main__":
    sys.exit(main())
