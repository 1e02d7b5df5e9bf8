#!/usr/bin/env bash
# BENCHMARKS.md's goal table re-measured in ONE device call on one H200: every result file records the
# same device call (ANGELGPT_BENCH_CALL, set here once), so the report takes its ratios from them.
#   a7   (a) megatron at 7 layers, micro batch 2, global batch 32, no recompute
#   d7   (d) zero_cache, the same
#   b11  (b) megatron_cpu_offload at 11 layers, micro batch 1, no recompute, offload fraction 0.5
#   d11  (d) zero_cache, the same model and batches
#   a8   (a) at its largest size: 8 layers, micro batch 2 (the preset's full recompute)
#   a8m1 (a) at 8 layers, micro batch 1: only when a8 did not complete
#   d19  (d) at its largest size at global batch 32: 19 layers, micro batch 2, model.recompute=auto
#   d8   (d) at 8 layers, model.recompute=auto, a8's micro batch: only when (a) completed 8 layers (the
#        speed ratio at (a)'s largest size needs both)
# FAMILY=llama measures the Llama family instead (benchmarks/peers.py --family llama: the llama3-8b
# preset's layer at sequence 4096, global batch 32, micro batch 1, model.recompute=auto):
#   m32  megatron at 32 layers, Llama-3-8B itself (the planner expects it short of GPU memory: a refusal
#        is its result)
#   m24  megatron at its largest size by the planner: 24 layers
#   z24  zero_cache, the same (the speed ratio at Megatron's largest)
#   z32  zero_cache at Llama-3-8B, exact states
#   z44  zero_cache at its largest size by the planner with exact states: 44 layers (48 fits by 0.3 GiB
#        of host memory)
# Estimates at 5 iterations from the planner's step times and 60-90 s of start: m32 20, m24 110, z24 120,
# z32 140, z44 190: 580 s, so run it with BUDGET_S=590 and the call's limit at 600.
# From the repository root on the device machine:
#   source scripts/device_wheels.sh && bash scripts/goal_table.sh [TREE]
# TREE: a `git archive` of the commit to measure, its sha in TREE/.commit (the working tree may hold
# unfinished work; see scripts/bench_ab.sh); without it this checkout, its commit from ANGELGPT_COMMIT or
# git. Result files go to benchmarks/results/ (a case run again is NAME-runN.json) and, when $OUT is set,
# are copied there with the log. ITERS=4 and WARMUP=2 by default: the median of the last two steps, as the
# before/after runs of scripts/bench_ab.sh took it (refactor-megatron-L7-...: 556.2 and 557.1 against
# 556.4 from six steps in peers-megatron-L7-mb2-gb32-recomputenone.json).
# Time: BUDGET_S (default 560) counts from the start of the calling shell (the wheels' install included);
# a case starts only when its estimate fits in what is left (beside what a8 and a8m1 leave for d19), and
# is stopped at the budget. Estimates at 4 iterations, from the wall times of the earlier result files:
# a7 55, d7 50, b11 112, d11 68, a8 60 (about 40 if it runs out of memory again), d19 118: 463 s; a8m1 or
# d8 60 more: about 525 s in all.
# ONLY="KEY ..." runs those cases alone (a7 d7 d16: the 7-layer pair and d16, zero_cache at 16 layers, micro
# batch 2, model.recompute=auto, about 165 s at 5 iterations; d16 runs only when named).
# A case that breaks (no result file, or a failure other than running out of memory or a refusal) stops
# the rest; d7 and d11 run only when their partner completed (their ratio needs both from this call).
set -u
tree=${1:-$PWD}
if [ ! -d "$tree/angelgpt" ]; then
  echo "goal_table.sh: '$tree' is not an angelgpt tree (a git archive of a commit, or this checkout)" >&2
  exit 2
fi
tree=$(cd "$tree" && pwd)
commit=$(python3 -c "import sys; sys.path.insert(0, '.'); from benchmarks.results import commit; print(commit('$tree'))")
if [ "$commit" = unknown ]; then
  echo "goal_table.sh: the commit measured is unknown: pass a tree with TREE/.commit, or set ANGELGPT_COMMIT" >&2
  exit 2
fi
export PYTHONPATH=$tree${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
export ANGELGPT_BENCH_CALL=${ANGELGPT_BENCH_CALL:-goal-$(date -u +%Y%m%dT%H%M%SZ)-$(cut -c1-8 /proc/sys/kernel/random/boot_id)}
results=${ANGELGPT_BENCH_OUT:-$PWD/benchmarks/results}
iters=${ITERS:-4} warmup=${WARMUP:-2} budget=${BUDGET_S:-560} family=${FAMILY:-gpt}
elapsed0=$(ps -o etimes= -p "$PPID" 2>/dev/null | tr -d ' ')
start=$((SECONDS - ${elapsed0:-0}))
log=$(mktemp -d)/goal_table.log
declare -A state
broken=""
echo "goal_table.sh: commit $commit, device call $ANGELGPT_BENCH_CALL, $iters iterations ($warmup warm-up), " \
  "budget $budget s, $((SECONDS - start)) s gone" | tee "$log"

collect() {  # this call's result files and the log into $OUT
  echo "states: $(for k in "${!state[@]}"; do printf '%s=%s ' "$k" "${state[$k]:-not run}"; done)" \
    "in $((SECONDS - start)) s" | tee -a "$log"
  [ -n "${OUT:-}" ] || return 0
  python3 - "$results" "$ANGELGPT_BENCH_CALL" "$OUT" <<'EOF'
import json, shutil, sys
from pathlib import Path

results, call, out = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
for f in sorted(results.glob("*.json")):
    try:
        r = json.loads(f.read_text())
    except ValueError:
        continue
    if isinstance(r, dict) and r.get("call") == call:
        shutil.copy2(f, out / f.name)
        print("copied", f.name)
EOF
  cp "$log" "$OUT/"
}
trap collect EXIT

outcome() {  # ok | oom | broken: what the newest file of case NAME from this call says
  python3 - "$results" "$ANGELGPT_BENCH_CALL" "$1" <<'EOF'
import json, re, sys
from pathlib import Path

results, call, name = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
mine = [r for f in results.glob(f"{name}*.json") if re.fullmatch(re.escape(name) + r"(-run\d+)?", f.stem)
        for r in [json.loads(f.read_text())] if r.get("call") == call]
r = max(mine, key=lambda r: r.get("date", ""), default=None)
print("broken" if r is None else "ok" if r.get("tflops_per_gpu_median") else "oom" if r.get("oom") else "broken")
EOF
}

skip() {
  state[$1]=skipped
  echo "== $1: skipped: $2" | tee -a "$log"
}

# case KEY ESTIMATE_S RESERVE_S SPEC [NEEDED_KEY]: one bench_peers case (SPEC as bench_peers takes it)
case_() {
  local key=$1 est=$2 reserve=$3 spec=$4 need=${5:-}
  local left=$((budget - (SECONDS - start)))
  if [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $key "* ]]; then state[$key]=skipped; return; fi
  if [ -n "$broken" ]; then skip "$key" "$broken broke"; return; fi
  if [ -n "$need" ] && [ "${state[$need]:-}" != ok ]; then
    skip "$key" "$need did not complete (${state[$need]:-not run}): no ratio from this call"; return
  fi
  if [ $((left - reserve)) -lt "$est" ]; then
    skip "$key" "$left s left, it needs about $est s (and $reserve s stay for what follows)"; return
  fi
  echo "== $key: $spec (about $est s; $left s left)" | tee -a "$log"
  local t0=$SECONDS caselog name
  caselog=$(mktemp)
  timeout -k 10 $((left - 5)) python3 scripts/bench_peers.py run "$spec" --family "$family" --force --iters "$iters" \
    --warmup "$warmup" --root "$tree" --extra zero_cache.is_communication_time_profiling=true > "$caselog" 2>&1
  local rc=$?
  cat "$caselog" >> "$log"
  name=$(grep -o -- "--name [^ ]*" "$caselog" | head -1 | cut -d' ' -f2)
  state[$key]=$(if [ -n "$name" ] && [ $rc -ne 124 ] && [ $rc -ne 137 ]; then outcome "$name"; else echo broken; fi)
  echo "== $key: ${state[$key]} in $((SECONDS - t0)) s (exit $rc, $name)" | tee -a "$log"
  grep -E "^(wrote|plan:|resolved:)|rror" "$caselog" | cut -c1-300
  if [ "${state[$key]}" = broken ]; then broken=$key; fi
}

if [ "$family" = llama ]; then
  case_ m32 20 0 "megatron:32:1:32:model.recompute=auto"
  case_ m24 110 0 "megatron:24:1:32:model.recompute=auto"
  case_ z24 120 0 "zero_cache:24:1:32:model.recompute=auto" m24
  case_ z32 140 0 "zero_cache:32:1:32:model.recompute=auto"
  case_ z44 190 0 "zero_cache:44:1:32:model.recompute=auto"
  [ -z "$broken" ]
  exit
fi
if [ -n "${ONLY:-}" ]; then
  case_ a7 60 0 "megatron:7:2:32:model.recompute=none"
  case_ d7 55 0 "zero_cache:7:2:32:model.recompute=none" a7
  case_ d16 165 0 "zero_cache:16:2:32:model.recompute=auto"
  [ -z "$broken" ]
  exit
fi
case_ a7 55 0 "megatron:7:2:32:model.recompute=none"
case_ d7 50 0 "zero_cache:7:2:32:model.recompute=none" a7
case_ b11 112 0 "megatron_cpu_offload:11:1:32:optim.offload_fraction=0.5,model.recompute=none"
case_ d11 68 0 "zero_cache:11:1:32:model.recompute=none" b11
case_ a8 60 118 "megatron:8:2:32"
a8_mb=2
if [ "${state[a8]:-}" != ok ]; then
  case_ a8m1 60 118 "megatron:8:1:32"
  a8_mb=1
fi
case_ d19 118 0 "zero_cache:19:2:32:model.recompute=auto"
if [ "${state[a8]:-}" = ok ] || [ "${state[a8m1]:-}" = ok ]; then
  case_ d8 60 0 "zero_cache:8:$a8_mb:32:model.recompute=auto"
fi
[ -z "$broken" ]
