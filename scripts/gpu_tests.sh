#!/usr/bin/env bash
# tests/gpu on a GPU machine (the device), and its result file: every test's outcome and duration with
# the commit and the machine (a failure's message with it), benchmarks/results/gpu-tests-<short commit>.json
# (or RESULT). Installs any wheels found in .whl/ (megatron-core and what else the machine lacks). Runs the
# tests PYTEST_WORKERS at a time (pytest-xdist, default 6: the tests are small models sharing the one GPU).
#   ANGELGPT_COMMIT=$(git rev-parse HEAD) bash scripts/gpu_tests.sh [RESULT] [PYTEST ARGS...]
# A second call with the same RESULT and other tests (a part of tests/gpu per call) adds to the file.
# PYTEST_TIME_LIMIT=S interrupts pytest after S seconds (a call that must end in its device time); the
# file then holds the tests that ended, and the run's exit code is 124.
set -u
cd "$(dirname "$0")/.."
if [ -z "${ANGELGPT_COMMIT:-}" ]; then  # a copied tree's .git may be stale: the caller names the commit
  echo "gpu_tests.sh: set ANGELGPT_COMMIT to the commit of the tree being run (git rev-parse HEAD where it was copied from)" >&2
  exit 2
fi
result=${1:-benchmarks/results/gpu-tests-${ANGELGPT_COMMIT:0:7}.json}
shift || true
. scripts/device_wheels.sh
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
junit=$(mktemp --suffix .xml)
started=$(date -u +%FT%TZ)
limit=()  # PYTEST_TIME_LIMIT=S: pytest interrupted after S seconds; the file keeps the tests that ended
if [ -n "${PYTEST_TIME_LIMIT:-}" ]; then limit=(timeout -s INT -k 30 "$PYTEST_TIME_LIMIT"); fi
${limit[@]+"${limit[@]}"} python3 -m pytest -q -p no:cacheprovider -n "${PYTEST_WORKERS:-6}" --junitxml "$junit" -o junit_family=xunit1 \
  "${@:-tests/gpu}"
code=$?
python3 - "$junit" "$result" "$started" "$code" "$*" <<'PY'
import json, os, re, socket, subprocess, sys, xml.etree.ElementTree as ET
from pathlib import Path

junit, result, started, code, args = sys.argv[1:]


def why(message: str) -> str:
    """A failure's first line and its last error line (an assertion's message may print a whole config
    before the child process's error at its end)."""
    lines = [l.strip() for l in message.strip().splitlines() if l.strip()]
    errors = [l for l in lines[1:] if re.search(r"(Error|Exception|error): *\S", l)]
    return (lines[0][:240] + (" ... " + errors[-1][:400] if errors else "")) if lines else ""


tests = []
for case in ET.parse(junit).iter("testcase"):
    outcome, message = "passed", None
    for child in case:
        if child.tag in ("failure", "error"):
            outcome = "failed" if child.tag == "failure" else "error"
            message = why(child.get("message") or "")  # kept with the outcome
        elif child.tag == "skipped":
            outcome = "skipped"
    if case.get("name") is None:  # a worker's entry when PYTEST_TIME_LIMIT interrupted it: no test's outcome
        continue
    path = case.get("file") or case.get("classname", "").replace(".", "/") + ".py"
    entry = {"nodeid": f"{path}::{case.get('name')}", "outcome": outcome,
             "duration_s": round(float(case.get("time", 0)), 2)}
    if message:
        entry["message"] = message
    props = {p.get("name"): p.get("value") for p in case.iter("property")}
    if props:  # figures a test measured (record_property)
        entry["properties"] = props
    tests.append(entry)
try:
    gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                         capture_output=True, text=True).stdout.strip()
except FileNotFoundError:  # no GPU driver here: the tests skip, and the file says so
    gpu = "none"
import torch
run = {"started": started, "command": f"bash scripts/gpu_tests.sh {result} {args}".strip(), "exit_code": int(code),
       "torch": torch.__version__, "tests": [t["nodeid"] for t in tests]}
path = Path(result)
data = json.loads(path.read_text()) if path.is_file() else {
    "commit": os.environ["ANGELGPT_COMMIT"], "machine": {"gpu": gpu, "host": socket.gethostname(),
                                                          "cpus": os.cpu_count()}, "runs": [], "tests": []}
if data["commit"] != os.environ["ANGELGPT_COMMIT"]:
    sys.exit(f"gpu_tests.sh: {result} holds commit {data['commit']}, not {os.environ['ANGELGPT_COMMIT']}")
known = {t["nodeid"] for t in tests}
data["tests"] = [t for t in data["tests"] if t["nodeid"] not in known] + tests
data["runs"].append(run)
path.parent.mkdir(parents=True, exist_ok=True)
path.write_text(json.dumps(data, indent=1) + "\n")
counts = {}
for t in data["tests"]:
    counts[t["outcome"]] = counts.get(t["outcome"], 0) + 1
print(f"wrote {result}: {counts}")
PY
exit $code
