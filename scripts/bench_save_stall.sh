#!/usr/bin/env bash
# How long a checkpoint save stalls training, with checkpoint.async_save false and then true, on one GPU:
#   source scripts/device_wheels.sh; bash scripts/bench_save_stall.sh
# The 55 shape (h200-16b preset) with ZeRO-Cache and model.recompute=auto, micro batch 2, global batch
# 32, as scripts/bench_peers.py runs its zero_cache case, but not at its 19 layers: a checkpoint holds
# 14 bytes per parameter (bf16 weights, fp32 master and two moments), 205 GiB at 19 layers (15.7B
# parameters), and the GPU machine's disk is 64 GiB. Each layer is 0.81B parameters, 10.5 GiB of
# checkpoint (1 layer 16.1 GiB, 2 layers 26.6 GiB, 3 layers 37.1 GiB, with the embeddings). LAYERS
# defaults to the most layers, at most MAX_LAYERS (2: about 240 s for both runs), whose checkpoint takes
# at most 80% of the free disk under SAVE_DIR less 2 GiB: the mid-run checkpoint is deleted as soon as it
# is finalized, before the run's last save writes its own.
# Each run trains ITERS (6) iterations with a save at SAVE_AT (3): a synchronous write, or one staged and
# written in the background while iterations SAVE_AT+1.. run; the run's last save is synchronous in both.
# One result file per run, scripts/bench_train.py's (command, commit, machine, per-iteration records)
# with a `save` section: stall_s (the loop blocked by the save at SAVE_AT), write_s and finalize_s, the
# step times before and after it, the checkpoint's size. Files:
# benchmarks/results/save-stall-L<LAYERS>-{sync,async}.json (RESULTS names another folder), copied into
# $OUT when set. SIZE and EXTRA (more KEY=VALUE overrides) let it run elsewhere, e.g. on CPU:
#   SIZE=tiny LAYERS=2 EXTRA="train.device=cpu" bash scripts/bench_save_stall.sh
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}  # bench_train.py imports angelgpt from this tree
SIZE=${SIZE:-h200-16b}
RESULTS=${RESULTS:-benchmarks/results}
ITERS=${ITERS:-6}
SAVE_AT=${SAVE_AT:-3}
SAVE_DIR=${SAVE_DIR:-$PWD/.bench_save_stall}
mkdir -p "$SAVE_DIR"
rm -rf "${SAVE_DIR:?}"/*
if [ -z "${LAYERS:-}" ]; then
  LAYERS=$(python3 - "$SAVE_DIR" "$SIZE" "${MAX_LAYERS:-2}" <<'EOF'
import shutil, sys
from angelgpt.config import parse
from angelgpt.model.flops import num_params
room = 0.8 * shutil.disk_usage(sys.argv[1]).free - 2 * 2**30
fits = [L for L in range(1, int(sys.argv[3]) + 1)
        if 14 * num_params(parse(sys.argv[2], overrides=[f"model.num_layers={L}"])) <= room]
print(fits[-1] if fits else 0)
EOF
)
fi
if [ "${LAYERS:-0}" -lt 1 ]; then
  echo "bench_save_stall.sh: not even one layer's checkpoint fits in 80% of the free disk under $SAVE_DIR" >&2
  exit 2
fi
FREE_GIB=$(python3 -c "import shutil,sys; print(round(shutil.disk_usage(sys.argv[1]).free / 2**30, 1))" "$SAVE_DIR")
echo "bench_save_stall: $LAYERS layers, $FREE_GIB GiB free under $SAVE_DIR"
mid="$SAVE_DIR/iter_$(printf %07d "$SAVE_AT")"
status=0
for mode in sync async; do
  async=false; [ "$mode" = async ] && async=true
  log=$(mktemp)
  # the mid-run checkpoint, once finalized (the tracker names it): its size noted, then deleted
  ( while [ "$(cat "$SAVE_DIR/latest_checkpointed_iteration.txt" 2>/dev/null)" != "$SAVE_AT" ]; do sleep 0.2; done
    du -sb "$mid" | awk '{printf "%.2f", $1 / 2^30}' > "$SAVE_DIR.gib"; rm -rf "$mid" ) &
  watcher=$!
  python3 scripts/bench_train.py --name "save-stall-L$LAYERS-$mode" --size "$SIZE" --iters "$ITERS" \
    --warmup 1 --out "$RESULTS" -- model.num_layers="$LAYERS" train.micro_batch_size=2 train.global_batch_size=32 \
    optim.lr_warmup_iters=1 optim.optimizer=zero_cache zero_cache.prefetch_cache_sub_group_rate=auto \
    model.recompute=auto checkpoint.save="$SAVE_DIR" checkpoint.save_interval="$SAVE_AT" \
    checkpoint.async_save=$async ${EXTRA:-} > "$log" 2>&1
  sleep 1
  kill "$watcher" 2>/dev/null; wait "$watcher" 2>/dev/null
  cat "$log"
  line=$(grep "^wrote " "$log" | tail -1)
  # a background write finalized only by the run's last save is in the log, not in the records
  background=$(grep -o "checkpoint of iteration $SAVE_AT written in the background in [0-9.]* s (finalized in [0-9.]* s)" "$log" | tail -1)
  rm -f "$log"
  result=${line#wrote }; result=${result%%: *}
  if [ -z "$line" ] || [ ! -f "$result" ]; then
    echo "bench_save_stall.sh: the $mode run wrote no result file" >&2
    status=1
    rm -rf "${SAVE_DIR:?}"/* "$SAVE_DIR.gib"
    continue
  fi
  python3 - "$result" "$SAVE_AT" "$(cat "$SAVE_DIR.gib" 2>/dev/null)" "$FREE_GIB" "$SAVE_DIR" "$background" <<'EOF'
import json, re, statistics, sys
path, save_at, ck_gib, free_gib, save_dir = sys.argv[1], int(sys.argv[2]), sys.argv[3], float(sys.argv[4]), sys.argv[5]
logged = re.findall(r"[0-9.]+(?= s)", sys.argv[6])
r = json.load(open(path))
recs = {x["iteration"]: x for x in r["records"]}
events = [x["checkpoint"] for x in r["records"] if x.get("checkpoint", {}).get("save_iteration") == save_at]
started = next((e for e in events if "stall_s" in e), {})
finished = next((e for e in events if "write_s" in e), {})
if not finished and len(logged) == 2:
    finished = {"write_s": float(logged[0]), "finalize_s": float(logged[1]), "from": "log"}
before = [recs[i]["elapsed_ms"] for i in recs if r["warmup_iters"] < i <= save_at]
after = [recs[i]["elapsed_ms"] for i in sorted(recs) if i > save_at]
r["save"] = {
    "save_iteration": save_at, "async": started.get("async"), "stall_s": started.get("stall_s"),
    "staged_gib": started.get("staged_gib"), "write_s": finished.get("write_s"),
    "finalize_s": finished.get("finalize_s"), "times_from": finished.get("from", "records") if finished else None,
    "step_ms_before_save_median": statistics.median(before) if before else None,
    "step_ms_after_save": after, "checkpoint_gib": float(ck_gib) if ck_gib else None,
    "disk_free_gib_before": free_gib, "save_dir": save_dir,
}
open(path, "w").write(json.dumps(r, indent=2) + "\n")
print("save:", json.dumps(r["save"]))
EOF
  rm -rf "${SAVE_DIR:?}"/* "$SAVE_DIR.gib"
  if [ -n "${OUT:-}" ]; then cp "$result" "$OUT/"; fi
done
rm -rf "${SAVE_DIR:?}"
exit $status
