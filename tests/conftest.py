"""Shared helpers: run the real `angelgpt` CLI in a subprocess, read its metrics file."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# the shared corpus beside the checkout when present, else the public-domain copy kept with the tests
_SHARED = ROOT.parent / "shared" / "data" / "tinyshakespeare.txt"
CORPUS = _SHARED if _SHARED.is_file() else ROOT / "tests" / "data" / "tinyshakespeare.txt"


def run_cli(*args, timeout=600, env=None):
    full_env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-m", "angelgpt", *map(str, args)], cwd=ROOT, text=True,
                          capture_output=True, timeout=timeout, env=full_env)


def read_metrics(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def train_tiny(tmp_path, name, *overrides, nproc=1, with_output=False):
    """Trains the tiny preset on CPU and returns its per-iteration metrics (and its stdout)."""
    metrics = tmp_path / f"{name}.jsonl"
    proc = run_cli("train", "--size", "tiny", "--device", "cpu", "--nproc-per-node", nproc,
                   "--metrics-file", metrics, "logging.log_interval=1", *overrides)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return (read_metrics(metrics), proc.stdout) if with_output else read_metrics(metrics)


@pytest.fixture
def corpus():
    if not CORPUS.is_file():
        pytest.skip(f"{CORPUS} not present")
    return CORPUS
