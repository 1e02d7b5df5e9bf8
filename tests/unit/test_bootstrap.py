"""scripts/bootstrap.sh's editable install prints nothing: setuptools' notice about this layout's
editable install (a 9-line box pip shows even under -q) is silenced by the warning filter the script
gives that pip call, and the editable install still imports angelgpt, presets included."""

import os
import re
import shutil
import subprocess
import sys

from tests.helpers import ROOT


def _editable_install(src, prefix, warnings_filter=None):
    env = dict(os.environ, PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
    env.pop("PYTHONWARNINGS", None)
    if warnings_filter:
        env["PYTHONWARNINGS"] = warnings_filter
    # into a prefix of its own; --ignore-installed: an angelgpt installed where the tests run stays as it is
    return subprocess.run([sys.executable, "-m", "pip", "install", "-q", "-e", ".", "--no-deps", "--ignore-installed",
                           "--no-build-isolation", "--prefix", str(prefix)],
                          cwd=src, env=env, text=True, capture_output=True, timeout=300)


def test_bootstraps_editable_install_prints_no_setuptools_notice(tmp_path):
    script = (ROOT / "scripts" / "bootstrap.sh").read_text()
    (quiet,) = re.findall(r'^QUIET_EDITABLE="([^"]+)"', script, re.M)
    assert '$QUIET_EDITABLE" .venv/bin/python -m pip install -q -e ".[test]"' in script
    src = tmp_path / "src"  # a copy: the install writes angelgpt.egg-info beside pyproject.toml
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    for name in ("angelgpt", "configs"):
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.so"))

    loud = _editable_install(src, tmp_path / "loud")
    assert loud.returncode == 0, loud.stderr[-3000:]
    assert "Editable installation" in loud.stdout + loud.stderr  # what the filter is for
    quiet_run = _editable_install(src, tmp_path / "quiet", quiet)
    assert quiet_run.returncode == 0, quiet_run.stderr[-3000:]
    assert quiet_run.stdout + quiet_run.stderr == ""

    (site,) = (tmp_path / "quiet").glob("lib/python*/site-packages")
    work = tmp_path / "work"
    work.mkdir()
    # -S: this environment's own angelgpt (if installed) out of the way; the prefix's .pth files read
    code = (f"import site, importlib.resources; site.addsitedir({str(site)!r}); import angelgpt; "
            f"print(angelgpt.__file__); print(importlib.resources.files('angelgpt.configs') / 'tiny.yaml')")
    out = subprocess.run([sys.executable, "-S", "-c", code], cwd=work, text=True, capture_output=True, timeout=120,
                         env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert out.returncode == 0, out.stderr[-2000:]
    where, tiny = out.stdout.splitlines()
    assert where == str(src / "angelgpt" / "__init__.py")
    assert tiny == str(src / "configs" / "tiny.yaml")
