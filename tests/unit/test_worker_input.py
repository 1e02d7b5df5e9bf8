"""The worker's one input is `--run-config PATH`, the resolved run config `angelgpt train` writes:
anything else on its command line, or a config still holding an 'auto', is refused in one line with
exit code 2."""

import os
import subprocess
import sys

import pytest
import yaml

from angelgpt.config import parse, to_dict
from tests.helpers import ROOT, check_one_line_error

pytestmark = pytest.mark.subprocess  # every test starts the worker as torchrun would


def _worker(*args):
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "angelgpt.train.worker", *map(str, args)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("args, needle", [
    (("--size", "tiny", "train.device=cpu"), "the worker takes --run-config PATH (the resolved run config"),
    (("--run-config", "/nonexistent/run-config.yaml"), "config file not found: /nonexistent/run-config.yaml"),
])
def test_anything_but_a_run_config_is_refused_in_one_line(args, needle):
    check_one_line_error(_worker(*args), needle, in_worker=True)


def test_a_config_still_holding_auto_is_refused_in_one_line(tmp_path):
    path = tmp_path / "run-config.yaml"
    path.write_text(yaml.safe_dump(to_dict(parse("tiny", overrides=["train.device=cpu"])), sort_keys=False))
    proc = _worker(f"--run-config={path}")
    check_one_line_error(proc, f"{path} is not a resolved run config: ", in_worker=True)
    assert "model.transformer_impl" in proc.stderr and "still 'auto'" in proc.stderr
