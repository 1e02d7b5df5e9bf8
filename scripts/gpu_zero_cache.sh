#!/usr/bin/env bash
# ZeRO-Cache on one GPU: AdamW equality on CUDA tensors for every tier mix, then the peer cases of the
# 55 shape (PEER_CASES, see scripts/bench_peers.py) with the pipelined store's time profile.
# Result files (and logs) go to $1 (default benchmarks/results).
#   bash scripts/gpu_zero_cache.sh "$OUT"
set -u
out=${1:-benchmarks/results}
mkdir -p "$out"
export ANGELGPT_BENCH_OUT="$out"
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
py=${PYTHON:-python3}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}  # scripts import angelgpt from the checkout
# 1. AdamW equality on CUDA tensors (fp32 model on the GPU): device, host, NVMe tiers, offloaded weights
for spec in "0.0 none" "0.5 nvme" "1.0 none" "0.0 offload"; do
  set -- $spec
  extra=""
  [ "$2" = nvme ] && extra="zero_cache.nvme_path=/tmp/angelgpt-nvme-check zero_cache.host_max_gib=0.0015"
  [ "$2" = offload ] && extra="zero_cache.offload_params=true"
  ANGELGPT_CHECK_DEVICE=cuda $py -m torch.distributed.run --standalone --nproc-per-node 1 \
    tests/distributed/zero_cache_adamw_check.py "$out/adamw-cuda-rate$1-$2.json" \
    zero_cache.prefetch_cache_sub_group_rate=$1 $extra > "$out/adamw-cuda-$1-$2.log" 2>&1 \
    || tail -20 "$out/adamw-cuda-$1-$2.log"
done
$py - "$out" <<'EOF'
import glob, json, sys
rows = []
for f in sorted(glob.glob(f"{sys.argv[1]}/adamw-cuda-rate*.json")):
    r = json.load(open(f))[0]
    rows.append({"case": f.rsplit("/", 1)[1][len("adamw-cuda-"):-5], "first_update_max_rel_err": r["first_update_max_rel_err"],
                 "three_updates_rel_err": r["three_updates_rel_err"], "tiers": r["tiers"],
                 "offloaded_layers": r["offloaded_layers"]})
json.dump(rows, open(f"{sys.argv[1]}/zero_cache-adamw-cuda.json", "w"), indent=1)
print(json.dumps(rows, indent=1))
EOF
# 2. the 55 shape: Megatron and ZeRO-Cache at Megatron's largest size, ZeRO-Cache at 20 layers (profiled)
$py scripts/bench_peers.py run ${PEER_CASES:-megatron:8:4:32 zero_cache:8:4:32 zero_cache:20:2:32} --iters 6 --warmup 1 \
  --extra zero_cache.is_communication_time_profiling=true > "$out/peers.log" 2>&1 || tail -30 "$out/peers.log"
ls "$out"
