#!/usr/bin/env bash
# Before/after pairs in one device call: each case runs at an earlier commit's tree and at this one,
# one after the other on the same machine, each run its own result file (scripts/bench_train.py).
#   for c in OLD NEW; do mkdir .bench_$c; git archive $c | tar -x -C .bench_$c; echo $c > .bench_$c/.commit; done
#   bash scripts/bench_ab.sh .bench_OLD .bench_NEW OUTDIR PREFIX \
#     "megatron-L7:7:2:32:optim.optimizer=megatron,model.recompute=none" ...
# A case is NAME:LAYERS:MICRO:GLOBAL:KEY=VALUE,... on the h200-16b preset (the 55 shape's layers);
# ITERS (default 5) and WARMUP (default 2) set the run length. Files: OUTDIR/PREFIX-NAME-at-SHORTSHA.json.
# Equal settings where the two commits' defaults or planners differ: NEW_EXTRA="KEY=VALUE ..." goes to the
# new tree's runs only (a default the old commit did not have, set to the old behaviour), and with
# PIN_RESOLVED=1 the new tree's run takes the values the old run's launcher resolved (its `resolved:`
# line), so that an `auto` settled differently by a re-fitted planner does not change what is compared.
set -u
old=$1; new=$2; outdir=$3; prefix=$4; shift 4
if [ ! -f "$old/.commit" ] || [ ! -f "$new/.commit" ]; then
  echo "bench_ab.sh: each tree names its commit in TREE/.commit" >&2
  exit 2
fi
. "$(dirname "$0")/device_wheels.sh"
export PYTHONPATH=$new${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
mkdir -p "$outdir"
(grep MemAvailable /proc/meminfo; nvidia-smi --query-gpu=name,memory.total --format=csv) > "$outdir/machine.txt" 2>&1
for case in "$@"; do
  IFS=: read -r name layers micro global extra <<< "$case"
  pins=""
  for tree in "$old" "$new"; do
    sha=$(cut -c1-7 "$tree/.commit")
    more=""
    if [ "$tree" = "$new" ]; then more="${NEW_EXTRA:-} $pins"; fi
    # the commit each result records is its tree's (an ANGELGPT_COMMIT set for the call would name every run's)
    ANGELGPT_COMMIT=$(cat "$tree/.commit") python3 "$new/scripts/bench_train.py" --name "$prefix-$name-at-$sha" --size h200-16b --iters "${ITERS:-5}" \
      --warmup "${WARMUP:-2}" --out "$outdir" --root "$tree" model.num_layers="$layers" \
      train.micro_batch_size="$micro" train.global_batch_size="$global" optim.lr_warmup_iters=1 \
      zero_cache.is_communication_time_profiling=true ${extra//,/ } $more 2>&1 | grep -E "^(wrote|plan:|resolved:|angelgpt)" | cut -c1-400
    if [ "$tree" = "$old" ] && [ -n "${PIN_RESOLVED:-}" ]; then
      pins=$(python3 - "$outdir/$prefix-$name-at-$sha.json" <<'PY'
import json, sys

try:
    settings = json.load(open(sys.argv[1])).get("settings", [])
except (OSError, ValueError):
    settings = []
line = next((s for s in settings if s.startswith("resolved: ")), "")
print(" ".join(kv.strip() for kv in line[len("resolved: "):].split(",") if "=" in kv))
PY
)
      echo "pinned for the new tree: ${pins:-nothing (the old run resolved nothing)}"
    fi
  done
done
