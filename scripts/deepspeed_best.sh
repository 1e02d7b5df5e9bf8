#!/usr/bin/env bash
# DeepSpeed where the weights fit the GPU, in one call on a bare one-H200 machine (about 7-8 minutes):
# ZeRO-Offload (offload_optimizer cpu, offload_param none, host buffers pinned) at ZeRO-2 and ZeRO-3, at
# 7 layers of the 55 shape (micro batch 8, global batch 32, 6 steps: the length of angelgpt's 7-layer
# runs, so the LR schedule and the batches are theirs), then ZeRO-3's at 8 layers, the largest its host
# memory should hold (16 bytes a parameter on the host, 12 of them pinned: 102 GiB at 6.87B parameters;
# 9 layers would need 114 GiB plus the process). Each case is a result file of scripts/bench_peers.py
# run (under $OUT when set, the device's folder that comes back; else benchmarks/results/).
#   bash scripts/deepspeed_best.sh                      # the three cases below
#   bash scripts/deepspeed_best.sh deepspeed_zero3_offload_opt:9:8:32@4    # others: CASE@ITERS
# Run from the repository root; it sources scripts/device_wheels.sh (DeepSpeed and its dependencies from
# .whl/). DeepSpeed's CPU Adam is built first (ninja and g++, 60-90 s). A case starts only while the
# time left (BUDGET seconds from the start, default 540) covers its estimate.
set -u
cd "$(dirname "$0")/.."
begin=$(date +%s)
budget=${BUDGET:-540}
. scripts/device_wheels.sh
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
if [ -n "${OUT:-}" ]; then
  export ANGELGPT_BENCH_OUT=$OUT
fi
results=${ANGELGPT_BENCH_OUT:-benchmarks/results}
mkdir -p "$results"
log=$results/deepspeed_best.log
say() { echo "deepspeed_best: $*" | tee -a "$log"; }
(grep -E "MemTotal|MemAvailable" /proc/meminfo; nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
 python3 -c 'import torch, deepspeed; print("torch", torch.__version__, "deepspeed", deepspeed.__version__)') 2>&1 \
  | tee -a "$log"

t0=$(date +%s)
python3 -c 'from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load()' > "$results/cpu_adam_build.log" 2>&1
say "CPU Adam build exit $? in $(( $(date +%s) - t0 )) s"

# CASE@ITERS and the seconds a case is expected to take (start-up with pinning, then the steps)
if [ $# -gt 0 ]; then
  cases=("$@")
else
  cases=("deepspeed_zero3_offload_opt:7:8:32@6" "deepspeed_zero2_offload_opt:7:8:32@6" "deepspeed_zero3_offload_opt:8:8:32@4")
fi
for item in "${cases[@]}"; do
  case=${item%@*}; iters=${item##*@}
  [ "$iters" = "$item" ] && iters=6
  estimate=$(( 70 + 10 * iters ))
  left=$(( budget - ($(date +%s) - begin) ))
  if [ "$left" -lt "$estimate" ]; then
    say "$case: not started ($left s left, about $estimate s needed)"
    continue
  fi
  t0=$(date +%s)
  python3 scripts/bench_peers.py run "$case" --iters "$iters" --warmup 1 > "$results/${case//:/-}.log" 2>&1
  grep -E "^(case|wrote|resolved|bench_deepspeed)|rror|Killed" "$results/${case//:/-}.log" | cut -c1-600 | tee -a "$log"
  say "$case: $(( $(date +%s) - t0 )) s"
done

# each new run's losses beside angelgpt's 7-layer run of the same batches and schedule
python3 - "$results" <<'EOF' 2>&1 | tee -a "$log"
import json, sys
from pathlib import Path
ref = json.loads(Path("benchmarks/results/peers-megatron-L7-mb2-gb32-recomputenone.json").read_text())["records"]
print("angelgpt L7 (megatron, mb 2):", [round(r["lm_loss"], 3) for r in ref], [round(r["grad_norm"], 2) for r in ref])
for f in sorted(Path(sys.argv[1]).glob("peers-deepspeed_*.json")):
    r = json.loads(f.read_text())
    recs = r.get("records", [])
    print(f.name, "tflops", r.get("tflops_per_gpu_median"), "host", r.get("peak_host_gib"), "gpu", r.get("peak_gpu_gib"),
          "oom", r.get("oom_kind"), [round(x["lm_loss"], 3) for x in recs], [round(x["grad_norm"], 2) for x in recs],
          [x["lr"] for x in recs][:3])
EOF
