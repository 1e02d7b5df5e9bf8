"""logging.profile_steps, logging.wandb_mode and logging.wandb_project are checked before anything is
launched: a bad value, or W&B asked for where wandb is not installed, is one line and exit 2."""

import pytest

from angelgpt.config import ConfigError, parse
from tests.helpers import check_one_line_error, run_cli


@pytest.mark.parametrize("value, expected", [("2,3", [2, 3]), ("[1, 1]", [1, 1]), (" 4 , 9", [4, 9]),
                                             ("null", None)])
def test_profile_steps_start_end(value, expected):
    assert parse("tiny", overrides=[f"logging.profile_steps={value}"]).logging.profile_steps == expected


@pytest.mark.parametrize("value", ["3,2", "0,2", "2", "a,b", "[1, 2, 3]", "1.5,2", "[true, 2]"])
def test_profile_steps_need_end_at_or_after_start_at_or_after_one(value):
    with pytest.raises(ConfigError, match="logging.profile_steps"):
        parse("tiny", overrides=[f"logging.profile_steps={value}"])


def test_wandb_mode_is_one_of_wandbs():
    for mode in ("online", "offline", "disabled", "null"):
        parse("tiny", overrides=[f"logging.wandb_mode={mode}"])
    with pytest.raises(ConfigError, match="logging.wandb_mode must be 'online', 'offline', 'disabled'"):
        parse("tiny", overrides=["logging.wandb_mode=shared"])


@pytest.mark.subprocess
def test_bad_profile_steps_refused_by_the_cli():
    check_one_line_error(run_cli("train", "--size", "tiny", "--device", "cpu", "logging.profile_steps=5,4"),
                         "logging.profile_steps must be START,END with END >= START >= 1")


@pytest.mark.subprocess
def test_wandb_project_without_wandb_installed_is_refused_before_launch(tmp_path):
    # a meta-path finder that makes `wandb` look absent, as in an install without the [wandb] extra
    (tmp_path / "sitecustomize.py").write_text(
        "import sys\n"
        "class NoWandb:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'wandb' or name.startswith('wandb.'):\n"
        "            raise ModuleNotFoundError(f\"No module named '{name}'\")\n"
        "sys.meta_path.insert(0, NoWandb())\n")
    proc = run_cli("train", "--size", "tiny", "--device", "cpu", "logging.wandb_project=t",
                   env={"PYTHONPATH": str(tmp_path)})
    check_one_line_error(proc, "logging.wandb_project is set but wandb is not installed")
