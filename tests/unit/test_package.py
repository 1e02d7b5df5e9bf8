"""The presets live once, in the checkout's top-level configs/; a wheel carries them as the package
angelgpt.configs: installed outside the checkout, `angelgpt presets` lists and shows them with no
configs directory beside the package. The wheel holds every package under angelgpt/ (pyproject lists
them, since angelgpt.configs is mapped from outside angelgpt/ and discovery would not follow it) and its
data files (package-data: the planner's calibration.json)."""

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.helpers import ROOT


def _run(args, cwd, env=None, timeout=300):
    proc = subprocess.run(args, cwd=cwd, env=env, text=True, capture_output=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.subprocess
def test_wheel_carries_presets(tmp_path):
    # build from a copy of what the wheel is made of, so the checkout gets no build/ or *.egg-info
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    for name in ("angelgpt", "configs"):
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    offline = dict(os.environ, PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
    dist = tmp_path / "dist"
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(dist), "."],
         cwd=src, env=offline)
    (wheel,) = dist.glob("angelgpt-*.whl")
    members = set(zipfile.ZipFile(wheel).namelist())
    presets = sorted(p.name for p in (ROOT / "configs").glob("*.yaml"))
    assert presets and {f"angelgpt/configs/{name}" for name in presets} <= members, sorted(members)
    packages = {init.parent.relative_to(ROOT).as_posix() for init in (ROOT / "angelgpt").rglob("__init__.py")}
    missing = sorted(p for p in packages if f"{p}/__init__.py" not in members)
    assert not missing, f"packages not in the wheel (add them to pyproject's [tool.setuptools] packages): {missing}"
    data = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "angelgpt").rglob("*.json"))
    assert data and set(data) <= members, f"data files not in the wheel (pyproject's package-data): {data}"
    site = tmp_path / "site"
    _run([sys.executable, "-m", "pip", "install", "--no-deps", "--target", str(site), str(wheel)],
         cwd=tmp_path, env=offline)
    shutil.rmtree(src)

    work = tmp_path / "work"
    work.mkdir()
    env = dict(os.environ, PYTHONPATH=str(site), PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    where = _run([sys.executable, "-c", "import angelgpt; print(angelgpt.__file__)"], cwd=work, env=env)
    assert Path(where.strip()).resolve().is_relative_to(site.resolve()), where
    # the installed package's own copy, not the checkout's configs/ (the editable install maps that)
    presets_at = _run([sys.executable, "-c", "from angelgpt.config import PRESET_DIR; print(PRESET_DIR)"],
                      cwd=work, env=env)
    assert Path(presets_at.strip()).resolve() == (site / "angelgpt" / "configs").resolve(), presets_at

    # the planner's constants load from the installed package's calibration.json
    workspace = _run([sys.executable, "-c", "from angelgpt.planner.calibration import WORKSPACE; print(WORKSPACE)"],
                     cwd=work, env=env)
    assert int(workspace) == 3 * 2**30, workspace

    listed = _run([sys.executable, "-m", "angelgpt", "presets", "list"], cwd=work, env=env)
    names = {line.split()[0] for line in listed.splitlines()[1:] if line.strip()}
    assert {"tiny", "55", "28"} <= names, listed

    shown = json.loads(_run([sys.executable, "-m", "angelgpt", "presets", "show", "55", "--json"],
                            cwd=work, env=env))
    assert shown["config"]["model"]["num_layers"] == 68


def test_checkout_presets_are_the_top_level_configs():
    """From the checkout (an editable install, or the checkout on sys.path) the loader reads configs/."""
    from angelgpt.config import PRESET_DIR, preset_names

    assert PRESET_DIR.resolve() == (ROOT / "configs").resolve()
    assert {"tiny", "55", "28"} <= set(preset_names())
    assert not (ROOT / "angelgpt" / "config" / "presets").exists()  # one copy
