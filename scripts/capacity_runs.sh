#!/usr/bin/env bash
# ZeRO-Cache's compact states at their largest sizes on one H200, beside Megatron's distributed optimizer at
# its largest (7 layers of the 55 shape) for the speed ratio, in one device call (one result file per case,
# benchmarks.peers; the report takes ratios only from files of one call):
#   remainders (16 bytes a parameter with fp32 sums) at 18 layers, remainders and bf16 moments (12) at 23,
#   and the 28 preset's shape (26 layers, 128 heads of 128: 28.35B) with remainders, fp8 moments and bf16
#   sums (8.03 bytes a parameter) at global batch 8.
# ZeRO-Cache's cases run at micro batch 4: accumulating in the store, every micro batch after the first
# sends the host chunks' sums up and back down (fp32 with fp32 sums), and at micro batch 2 those round
# trips outlast the backward they hide behind (the planner: 18 layers 18.7 s a step at micro batch 2,
# 14.9 at 4; the 2-step runs at micro batch 2 measured 19.5 s); the compute rate is flat in the micro
# batch with full recompute (compute-grid.json).
#   bash scripts/capacity_runs.sh [ITERS] [WARMUP]     (default 4 and 1: three measured steps, which the
#                                                      report's size table counts)
# The 28 shape runs second: a 10-minute call may not reach the last cases (ANGELGPT_BENCH_OUT: where the
# result files go). A case run before gets its next -runN file.
# Installs any wheels found in .whl/ (scripts/device_wheels.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/device_wheels.sh
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export ANGELGPT_BENCH_CALL=${ANGELGPT_BENCH_CALL:-capacity-$(date -u +%Y%m%dT%H%M%SZ)-$$}
compact=optim.store_param_remainders=true,optim.exp_avg_dtype=bf16,optim.exp_avg_sq_dtype=bf16
python3 -m benchmarks.peers run --force --iters "${1:-4}" --warmup "${2:-1}" \
  megatron:7:2:32:model.recompute=none \
  zero_cache:26:4:8:model.num_attention_heads=128,model.kv_channels=128,optim.store_param_remainders=true,optim.exp_avg_dtype=fp8,optim.exp_avg_sq_dtype=fp8,optim.accumulate_grads_in_fp32=false \
  zero_cache:18:4:32:optim.store_param_remainders=true \
  zero_cache:23:4:32:$compact
