#!/usr/bin/env bash
# Creates .venv (when missing) and installs angelgpt with its test extras into it. Safe to run again.
#   bash scripts/bootstrap.sh            # then .venv/bin/angelgpt ...
# Torch: an already importable torch in .venv is kept; otherwise torch 2.13.0 is installed
# (the CPU build where a local wheel provides it, else PyPI's default build).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -c "import torch" 2>/dev/null || .venv/bin/python -m pip install -q "torch==2.13.0"
# setuptools' editable install of this layout (configs/ mapped to angelgpt.configs) ends with an
# informational warning, a 9-line box pip prints even under -q; only that message is silenced, only here
QUIET_EDITABLE="ignore:Editable installation:UserWarning"
PYTHONWARNINGS="${PYTHONWARNINGS:+$PYTHONWARNINGS,}$QUIET_EDITABLE" .venv/bin/python -m pip install -q -e ".[test]"
