#!/usr/bin/env bash
# The numerics of ZeRO-Cache's state formats on one GPU, in one device call: the corpus (this Python's
# standard library source) prepared once, a run per format from the same seed and batches (one result
# file each under OUT, benchmarks.numerics), and the curves side by side (OUT/numerics.svg).
#   bash scripts/numerics_runs.sh OUT [ITERS] [FORMAT...]
#     FORMAT: fp32 bf16-moments remainders-bf16-moments fp8-moments remainders-fp8-moments
# Installs any wheels found in .whl/ (scripts/device_wheels.sh). NUMERICS_DATA: where the prepared corpus is
# (or goes; default /tmp/numerics-data, lost with the machine: prepare it where it is cheaper, as
# `python -m benchmarks.numerics prepare --out .numerics-data`, and carry it). A 10-minute call may hold
# one or two formats at 2000 iterations run one after another, three side by side (NUMERICS_CONCURRENT=1).
# NUMERICS_SEEDS="1235 1236": a run per format and seed (train.seed=SEED, named numerics-seedSEED-FORMAT);
# without it one run per format at the config's seed, named numerics-FORMAT.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: numerics_runs.sh OUT [ITERS] [FORMAT...]}
iters=${2:-2000}
shift $(( $# < 2 ? $# : 2 ))
formats=("${@:-fp32 bf16-moments remainders-bf16-moments}")
. scripts/device_wheels.sh
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export ANGELGPT_BENCH_CALL=${ANGELGPT_BENCH_CALL:-numerics-$(date -u +%Y%m%dT%H%M%SZ)-$$}
data=${NUMERICS_DATA:-/tmp/numerics-data}
# NUMERICS_CONCURRENT=1: the formats train side by side on the one GPU (the host's cores split between
# them); NUMERICS_TIME_LIMIT=SECONDS: a run still going then is stopped and its curves so far written.
concurrent=${NUMERICS_CONCURRENT:-0}
limit=${NUMERICS_TIME_LIMIT:+--time-limit $NUMERICS_TIME_LIMIT}
[ -f "$data/manifest.json" ] || python3 -m benchmarks.numerics prepare --out "$data"
seeds=${NUMERICS_SEEDS:-}
lines=$(mktemp -d)
if [ "$concurrent" = 1 ]; then
  n=$(( $(echo ${formats[*]} | wc -w) * $(echo ${seeds:-one} | wc -w) ))
  export OMP_NUM_THREADS=$(( $(nproc) / n > 0 ? $(nproc) / n : 1 ))
fi
# one NAME LINE_FILE OVERRIDES...: a run; its last line (the result file it wrote, then the comparison;
# a run again of a name: NAME-runN.json) into LINE_FILE
one() { python3 -m benchmarks.numerics run --name "$1" --data "$data" --iters "$iters" --out "$out" \
        $limit -- "${@:3}" | tail -1 > "$2" || true; }
k=0
for seed in ${seeds:-none}; do
for f in ${formats[*]}; do
  case $f in
    fp32) extra=() ;;
    bf16-moments) extra=(optim.exp_avg_dtype=bf16 optim.exp_avg_sq_dtype=bf16) ;;
    remainders-bf16-moments) extra=(optim.store_param_remainders=true optim.exp_avg_dtype=bf16 optim.exp_avg_sq_dtype=bf16) ;;
    fp8-moments) extra=(optim.exp_avg_dtype=fp8 optim.exp_avg_sq_dtype=fp8) ;;
    remainders-fp8-moments) extra=(optim.store_param_remainders=true optim.exp_avg_dtype=fp8 optim.exp_avg_sq_dtype=fp8) ;;
    *) echo "numerics_runs.sh: unknown format $f" >&2; exit 2 ;;
  esac
  if [ "$seed" != none ]; then name=numerics-seed$seed-$f extra+=(train.seed=$seed); else name=numerics-$f; fi
  k=$((k + 1))
  if [ "$concurrent" = 1 ]; then one "$name" "$lines/$k" "${extra[@]}" & sleep 5; else one "$name" "$lines/$k" "${extra[@]}"; fi
done
done
wait
written=()
for i in $(seq 1 $k); do
  line=$(cat "$lines/$i" 2>/dev/null || true)
  echo "$line"
  [ -n "$line" ] && [ -f "${line%%: *}" ] && written+=("${line%%: *}")
done
# this call's runs in the order given: the first (fp32 by default) is what the others are compared with
[ ${#written[@]} -gt 0 ] && python3 -m benchmarks.numerics plot "${written[@]}" --out "$out/numerics.svg"
