#!/usr/bin/env bash
# GPU checks and peer benchmarks in one go, for an offline GPU machine: installs any wheels found in
# .whl/ (megatron-core and what else the machine lacks), optionally checks ZeRO-Cache's AdamW
# equality on CUDA tensors, runs the peer cases of scripts/bench_peers.py under a time guard, and
# packs every result file and log into OUTDIR/results.tgz.
#   ANGELGPT_COMMIT=$(git rev-parse HEAD) bash scripts/gpu_bench.sh OUTDIR SECONDS "zero_cache:20:2:2 megatron:7:4:32" [adamw]
#   ITERS=4 FORCE=1 bash scripts/gpu_bench.sh /tmp/out 300 "zero_cache:20:2:2"   (FORCE: run cases that have results)
#   ADAMW_SPECS="0.3:device_update" bash scripts/gpu_bench.sh /tmp/out 300 "zero_cache:19:2:32" adamw
set -u
outdir=$1; guard=$2; cases=$3; shift 3
if [ -z "${ANGELGPT_COMMIT:-}" ]; then  # a copied tree's .git may be stale: the caller names the commit
  echo "gpu_bench.sh: set ANGELGPT_COMMIT to the commit of the tree being run (git rev-parse HEAD where it was copied from)" >&2
  exit 2
fi
. "$(dirname "$0")/device_wheels.sh"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
work=$(mktemp -d)
export ANGELGPT_BENCH_OUT="$work"
(grep MemAvailable /proc/meminfo; nvidia-smi --query-gpu=name,memory.total --format=csv) > "$work/machine.txt"
if [ "${1:-}" = adamw ]; then
  for spec in ${ADAMW_SPECS:-"0.0:none" "0.5:nvme" "1.0:none" "0.0:offload" "0.3:device_update" "0.3:device_update_accumulate"}; do
    spec=${spec/:/ }
    set -- $spec
    extra="" micro=1
    [ "$2" = nvme ] && extra="zero_cache.nvme_path=$work/nvme zero_cache.host_max_gib=0.0015"
    [ "$2" = offload ] && extra="zero_cache.offload_params=true"
    [ "${2%_accumulate}" = device_update ] && extra="zero_cache.device_update_fraction=0.5 zero_cache.offload_params=false"
    [ "$2" = device_update_accumulate ] && extra="$extra zero_cache.accumulate_in_store=true" && micro=2
    ANGELGPT_CHECK_MICROBATCHES=$micro ANGELGPT_CHECK_DEVICE=cuda \
      timeout 120 python3 -m torch.distributed.run \
      --standalone --nproc-per-node 1 tests/distributed/zero_cache_adamw_check.py "$work/adamw-cuda-rate$1-$2.json" \
      zero_cache.prefetch_cache_sub_group_rate=$1 zero_cache.update_slice_numel=1024 $extra > "$work/adamw-cuda-$1-$2.log" 2>&1
  done
fi
timeout "$guard" python3 scripts/bench_peers.py run $cases --iters "${ITERS:-6}" --warmup 1 ${FORCE:+--force} \
  --extra zero_cache.is_communication_time_profiling=true > "$work/peers.log" 2>&1
mkdir -p "$outdir"
tar czf "$outdir/results.tgz" -C "$work" --exclude nvme .
grep -hE "^case:|profile|iteration +[0-9]+/|rror|wrote" "$work/peers.log" | cut -c1-330 | tail -45
