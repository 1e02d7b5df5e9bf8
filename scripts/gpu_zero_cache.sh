#!/usr/bin/env bash
# ZeRO-Cache on one GPU: AdamW equality on CUDA tensors for every tier mix, a 1.3b trajectory against
# optimizer megatron, and the pipelined store at 12 layers of the 55 shape with its time profile.
# Result files (and logs) go to $1 (default benchmarks/results).
#   bash scripts/gpu_zero_cache.sh "$OUT"
set -u
out=${1:-benchmarks/results}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
py=${PYTHON:-python3}
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
# 2. 1.3b, 20 steps, micro batch 4 x 4 per step: optimizer megatron against the pipelined zero_cache at rate 0.0
for case in "megatron optim.optimizer=megatron" \
            "zc-rate0 optim.optimizer=zero_cache zero_cache.prefetch_cache_sub_group_rate=0.0 zero_cache.is_communication_time_profiling=true"; do
  set -- $case
  name=$1; shift
  $py scripts/bench_train.py --name "1.3b-20steps-$name" --size 1.3b --iters 20 --warmup 5 --out "$out" -- \
    train.micro_batch_size=4 train.global_batch_size=16 optim.lr_warmup_iters=2 "$@" > "$out/1.3b-$name.log" 2>&1 \
    || tail -20 "$out/1.3b-$name.log"
done
# 3. the 55 shape: Megatron at 9 layers, ZeRO-Cache at 12 (profiled, the planner's rate)
ANGELGPT_BENCH_OUT="$out" $py scripts/bench_peers.py run megatron:9 zero_cache:12 --iters 6 --warmup 2 \
  --extra zero_cache.is_communication_time_profiling=true > "$out/peers-1.log" 2>&1 || tail -30 "$out/peers-1.log"
ls "$out"
