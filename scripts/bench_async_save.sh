#!/usr/bin/env bash
# How long asynchronous saves stall training after the first, on one GPU, for each optimizer: the 1.3b
# preset (global batch 256) trains ITERS (12) iterations saving every SAVE_EVERY (3) in the background,
# checkpoint.keep=1 (the disk holds two checkpoints at most); the run's last save is synchronous.
#   source scripts/device_wheels.sh; bash scripts/bench_async_save.sh
# One result file per optimizer, benchmarks/train.py's (command, commit, machine, per-iteration records)
# with a `saves` section: each save's stall_s (the training loop blocked), staged_gib, whether it was
# asynchronous, and the largest stall of the asynchronous saves after the first against the goal (1 s).
# Copied into $OUT when set. SIZE, ITERS, SAVE_EVERY, OPTIMIZERS and EXTRA (KEY=VALUE overrides) change it.
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
SIZE=${SIZE:-1.3b}
ITERS=${ITERS:-12}
SAVE_EVERY=${SAVE_EVERY:-3}
RESULTS=${RESULTS:-benchmarks/results}
SAVE_DIR=${SAVE_DIR:-$PWD/.bench_async_save}
status=0
for opt in ${OPTIMIZERS:-megatron zero_cache}; do
  rm -rf "${SAVE_DIR:?}"
  log=$(mktemp)
  python3 scripts/bench_train.py --name "async-save-$SIZE-$opt" --size "$SIZE" --iters "$ITERS" --warmup 1 \
    --out "$RESULTS" -- optim.optimizer="$opt" checkpoint.save="$SAVE_DIR" checkpoint.save_interval="$SAVE_EVERY" \
    checkpoint.async_save=true checkpoint.keep=1 ${EXTRA:-} > "$log" 2>&1
  cat "$log"
  line=$(grep "^wrote " "$log" | tail -1)
  rm -f "$log"
  result=${line#wrote }; result=${result%%: *}
  if [ -z "$line" ] || [ ! -f "$result" ]; then
    echo "bench_async_save.sh: the $opt run wrote no result file" >&2
    status=1
    continue
  fi
  python3 - "$result" <<'PY'
import json, sys
path = sys.argv[1]
r = json.load(open(path))
saves = [dict(x["checkpoint"], at_iteration=x["iteration"]) for x in r["records"] if "stall_s" in x.get("checkpoint", {})]
later = [s["stall_s"] for s in saves[1:] if s.get("async")]
r["saves"] = {"each": saves, "async_after_first": len(later),
              "max_stall_s_after_first": max(later) if later else None, "goal_stall_s": 1.0,
              "goal_met": bool(later) and max(later) <= 1.0}
open(path, "w").write(json.dumps(r, indent=2) + "\n")
print("saves:", json.dumps(r["saves"]))
PY
  if [ -n "${OUT:-}" ]; then cp "$result" "$OUT/"; fi
done
rm -rf "${SAVE_DIR:?}"
exit $status
