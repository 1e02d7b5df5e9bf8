#!/usr/bin/env bash
# Before/after pairs in one device call: each case runs at an earlier commit's tree and at this one,
# one after the other on the same machine, each run its own result file (scripts/bench_train.py).
#   git archive OLD_COMMIT | tar -x -C .bench_old && echo OLD_COMMIT > .bench_old/.commit   # here
#   ANGELGPT_COMMIT=$(git rev-parse HEAD) bash scripts/bench_ab.sh .bench_old OUTDIR PREFIX \
#     "megatron-L7:7:2:32:optim.optimizer=megatron,model.recompute=none" ...
# A case is NAME:LAYERS:MICRO:GLOBAL:KEY=VALUE,... on the h200-16b preset (the 55 shape's layers);
# ITERS (default 5) and WARMUP (default 2) set the run length. Files: OUTDIR/PREFIX-NAME-at-SHORTSHA.json.
set -u
old=$1; outdir=$2; prefix=$3; shift 3
if [ -z "${ANGELGPT_COMMIT:-}" ] || [ ! -f "$old/.commit" ]; then
  echo "bench_ab.sh: set ANGELGPT_COMMIT to this tree's commit and write the old tree's commit into $old/.commit" >&2
  exit 2
fi
if ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
echo "$ANGELGPT_COMMIT" > .commit  # this tree's commit, read by bench_train.py (a copied .git may be stale)
mkdir -p "$outdir"
(grep MemAvailable /proc/meminfo; nvidia-smi --query-gpu=name,memory.total --format=csv) > "$outdir/machine.txt" 2>&1
for case in "$@"; do
  IFS=: read -r name layers micro global extra <<< "$case"
  for tree in "$old" "$PWD"; do
    sha=$(cut -c1-7 "$tree/.commit")
    python3 scripts/bench_train.py --name "$prefix-$name-at-$sha" --size h200-16b --iters "${ITERS:-5}" \
      --warmup "${WARMUP:-2}" --out "$outdir" --root "$tree" model.num_layers="$layers" \
      train.micro_batch_size="$micro" train.global_batch_size="$global" optim.lr_warmup_iters=1 \
      zero_cache.is_communication_time_profiling=true ${extra//,/ } 2>&1 | grep -E "^(wrote|plan:|resolved:|angelgpt)" | cut -c1-400
  done
done
rm -f .commit
