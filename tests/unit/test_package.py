"""A wheel of the checkout carries the presets: installed outside the checkout, `angelgpt presets`
lists and shows them with no configs directory beside the package."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from tests.helpers import ROOT


def _run(args, cwd, env=None, timeout=300):
    proc = subprocess.run(args, cwd=cwd, env=env, text=True, capture_output=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_wheel_carries_presets(tmp_path):
    # build from a copy of what the wheel is made of, so the checkout gets no build/ or *.egg-info
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    shutil.copytree(ROOT / "angelgpt", src / "angelgpt", ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    offline = dict(os.environ, PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
    dist = tmp_path / "dist"
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(dist), "."],
         cwd=src, env=offline)
    (wheel,) = dist.glob("angelgpt-*.whl")
    site = tmp_path / "site"
    _run([sys.executable, "-m", "pip", "install", "--no-deps", "--target", str(site), str(wheel)],
         cwd=tmp_path, env=offline)
    shutil.rmtree(src)

    work = tmp_path / "work"
    work.mkdir()
    env = dict(os.environ, PYTHONPATH=str(site), PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    where = _run([sys.executable, "-c", "import angelgpt; print(angelgpt.__file__)"], cwd=work, env=env)
    assert Path(where.strip()).resolve().is_relative_to(site.resolve()), where

    listed = _run([sys.executable, "-m", "angelgpt", "presets", "list"], cwd=work, env=env)
    names = {line.split()[0] for line in listed.splitlines()[1:] if line.strip()}
    assert {"tiny", "55", "28"} <= names, listed

    shown = json.loads(_run([sys.executable, "-m", "angelgpt", "presets", "show", "55", "--json"],
                            cwd=work, env=env))
    assert shown["config"]["model"]["num_layers"] == 68
