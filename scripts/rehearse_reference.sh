#!/usr/bin/env bash
# Rehearsals of the reference jobs on one GPU (`angelgpt rehearse`), one result file each under
# benchmarks/results/ (rehearse-SIZE-MACHINE[-runN].json, named by benchmarks.results, with command, commit
# and this machine):
#   55 and 28 as shipped on the reference node (8x A100-40G, 1000 GiB host: --machine a100-40gx8
#   --host-mem 1000, so the GPU capped at 40 GiB less the CUDA context and ZeRO-Cache's host budget
#   1000/8 GiB a rank), and 55 on an 8x H200 node (--machine h200x8).
# From the repository root on the device machine:
#   source scripts/device_wheels.sh && bash scripts/rehearse_reference.sh [TREE] [CASE ...]
# CASE: 55-a100-40gx8 (default), 28-a100-40gx8, 55-h200x8; CASE@GIB caps the target's GPU at GIB instead
# (--gpu-mem GIB: a tighter cap than the machine's, rehearse-SIZE-MACHINE-gpuGIB.json). STEPS (default 3) steps a rank; each case is
# stopped after CASE_S seconds (default 300).
set -u
here=$(cd "$(dirname "$0")/.." && pwd)  # this checkout: its benchmarks package names the result files
tree=${1:-$PWD}; shift || true
cases=${*:-55-a100-40gx8 28-a100-40gx8 55-h200x8}
tree=$(cd "$tree" && pwd)
export PYTHONPATH=$tree${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
results=${ANGELGPT_BENCH_OUT:-$PWD/benchmarks/results}
mkdir -p "$results"
for c in $cases; do
  cap=; [ "${c#*@}" != "$c" ] && cap=${c#*@}; c=${c%@*}
  size=${c%%-*}; machine=${c#*-}
  host=1000; [ "$machine" = h200x8 ] && host=2048
  name=rehearse-$size-$machine${cap:+-gpu$cap}
  f=$(PYTHONPATH=$here python3 -m benchmarks.results path "$results" "$name")  # NAME.json, else NAME-runN.json
  echo "== $c -> $(basename "$f") ($(date -u +%T))"
  ( cd "$tree" && timeout -k 10 "${CASE_S:-300}" python3 -m angelgpt rehearse --size "$size" \
      --nproc-per-node 8 --machine "$machine" --host-mem "$host" ${cap:+--gpu-mem "$cap"} --steps "${STEPS:-3}" \
      --report "$f" ) 2>&1 | grep -v "Warning\|warn(" | cut -c1-600 | tail -40
  echo "exit ${PIPESTATUS[0]}"
  [ -n "${OUT:-}" ] && [ -f "$f" ] && cp "$f" "$OUT/"
done
