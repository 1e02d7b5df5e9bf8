#!/usr/bin/env bash
# One device call: install the carried wheels, run the given steps with a time guard, and pack every
# result file and log into $OUT/results.tgz (the device tool returns at most 8 files).
#   bash scripts/gpu_run.sh SECONDS "PEER_CASES" [adamw]
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
work=/tmp/angelgpt-results
mkdir -p "$work"
export ANGELGPT_BENCH_OUT="$work"
guard=$1; cases=$2; shift 2
(grep MemAvailable /proc/meminfo; nvidia-smi --query-gpu=name,memory.total --format=csv) > "$work/machine.txt"
if [ "${1:-}" = adamw ]; then
  for spec in "0.0 offload" "0.5 none"; do
    set -- $spec
    extra=""; [ "$2" = offload ] && extra="zero_cache.offload_params=true"
    ANGELGPT_CHECK_DEVICE=cuda ANGELGPT_ZERO_CACHE_SLICE=1000 timeout 120 python3 -m torch.distributed.run --standalone \
      --nproc-per-node 1 tests/distributed/zero_cache_adamw_check.py "$work/adamw-cuda-rate$1-$2.json" \
      zero_cache.prefetch_cache_sub_group_rate=$1 $extra > "$work/adamw-cuda-$1-$2.log" 2>&1
  done
fi
timeout "$guard" python3 scripts/bench_peers.py run $cases --iters ${ITERS:-6} --warmup 1 \
  --extra zero_cache.is_communication_time_profiling=true > "$work/peers.log" 2>&1
tar czf "$OUT/results.tgz" -C "$work" .
grep -hE "^case:|profile|iteration +[0-9]+/|rror|wrote" "$work/peers.log" | cut -c1-330 | tail -45
