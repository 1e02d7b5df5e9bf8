#!/usr/bin/env bash
# ZeRO-Cache checks and first throughput figures on one GPU; results and logs go to $1 (default benchmarks/results).
#   bash scripts/gpu_zero_cache.sh "$OUT"
set -u
out=${1:-benchmarks/results}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
py=${PYTHON:-python3}
# 1. AdamW equality on CUDA tensors, every tier mix
for spec in "0.0 none" "0.5 none" "1.0 none" "0.0 nvme" "0.5 nvme"; do
  set -- $spec
  extra=""
  [ "$2" = nvme ] && extra="zero_cache.nvme_path=/tmp/angelgpt-nvme zero_cache.host_max_gib=0.0004"
  ANGELGPT_CHECK_DEVICE=cuda $py -m torch.distributed.run --standalone --nproc-per-node 1 \
    tests/distributed/zero_cache_adamw_check.py "$out/adamw-cuda-rate$1-$2.json" \
    zero_cache.prefetch_cache_sub_group_rate=$1 $extra > "$out/adamw-cuda.log" 2>&1 || tail -20 "$out/adamw-cuda.log"
done
# 2. 1.3b, 20 steps, one micro batch per step: optimizer megatron against zero_cache at rate 0.0 and 1.0
for case in "megatron optim.optimizer=megatron" "zc-rate0 optim.optimizer=zero_cache zero_cache.prefetch_cache_sub_group_rate=0.0" \
            "zc-rate1 optim.optimizer=zero_cache zero_cache.prefetch_cache_sub_group_rate=1.0"; do
  set -- $case
  name=$1; shift
  $py scripts/bench_train.py --name "1.3b-20steps-$name" --size 1.3b --iters 20 --warmup 5 --out "$out" -- \
    train.micro_batch_size=4 train.global_batch_size=4 optim.lr_warmup_iters=2 "$@" > "$out/1.3b-$name.log" 2>&1 \
    || tail -20 "$out/1.3b-$name.log"
done
# 3. first throughput figure at hidden 8192: h200-5b with every state on the GPU
$py scripts/bench_train.py --name h200-5b-zero_cache-rate1 --size h200-5b --iters 8 --warmup 3 --out "$out" -- \
  optim.optimizer=zero_cache zero_cache.prefetch_cache_sub_group_rate=1.0 train.micro_batch_size=4 train.global_batch_size=16 \
  > "$out/5b-zc.log" 2>&1 || tail -20 "$out/5b-zc.log"
ls "$out"
