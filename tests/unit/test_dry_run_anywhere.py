"""`angelgpt train --dry-run` on a machine without a GPU: the checks that need CUDA are for the machine
that will run the job, so a GPU job's dry run prints its config here too, and in place of the torchrun
command that the machine that runs the job resolves it; with --machine NAME it prints the plan for that
catalogue machine, its 'auto' values resolved, and the command on the run config it wrote."""

import pytest

from tests.helpers import check_one_line_error, run_cli_in_process as run_cli

JOB = ("train", "--size", "55", "--nproc-per-node", "8", "--dry-run")


@pytest.fixture(autouse=True)
def run_configs_in_tmp_path(tmp_path, monkeypatch):
    """A dry run's run config goes to a directory of its own under the temporary directory: this test's."""
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))


@pytest.fixture(scope="module")
def no_gpu():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible here: these tests are of a machine without one")


def _torchrun_line(proc):
    return next(l for l in proc.stdout.splitlines() if l.startswith("torchrun command: "))


def test_gpu_job_dry_run_without_a_gpu_prints_config_command_and_skips_the_plan(no_gpu):
    proc = run_cli(*JOB)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    assert "num_layers: 68" in proc.stdout and "params: 55,198,007,296" in proc.stdout
    line = _torchrun_line(proc)  # nothing resolved here, so no run config to run on
    assert line.startswith("torchrun command: none: its run config is resolved for the machine that runs the job")
    assert "run config: " not in proc.stdout
    skipped = [l for l in proc.stdout.splitlines() if l.startswith("plan: skipped")]
    assert len(skipped) == 1 and "no GPU is visible" in skipped[0], proc.stdout
    assert "resolved:" not in proc.stdout


def test_dry_run_with_machine_prints_that_machines_plan(no_gpu):
    from angelgpt.config import parse
    from angelgpt.planner import GIB, machine_from, resolve_config

    proc = run_cli(*JOB, "--machine", "a100-40gx8")
    assert proc.returncode == 0, proc.stderr
    assert "--nproc-per-node 8" in _torchrun_line(proc) and "-m angelgpt.train.worker --run-config " in _torchrun_line(proc)
    assert "plan: skipped" not in proc.stdout
    assert "target machine: a100-40gx8 (8 x A100 39.4 GiB" in proc.stdout
    # the 'auto' values resolved for the target's GPUs, and the plan of that config for it
    resolved = next(l for l in proc.stdout.splitlines() if l.startswith("resolved: "))
    assert "train.device=cuda" in resolved and "zero_cache.device_update_fraction=" in resolved
    assert "device: cuda" in proc.stdout
    cfg, planned = resolve_config(parse("55", None, []), machine_from("a100-40gx8", gpus_per_node=8), 8, 1, True)
    plan_line = next(l for l in proc.stdout.splitlines() if l.startswith("plan: "))
    assert (f"plan: {planned.system} needs {planned.gpu_total / GIB:.1f} GiB per GPU and "
            f"{planned.host_total / GIB:.1f} GiB of host memory per node") in plan_line, plan_line
    assert f"zero_cache.device_update_fraction={cfg.zero_cache.device_update_fraction}" in resolved
    # the command's run config: that resolved config, every 'auto' a value
    from angelgpt.config import ResolvedConfig
    from angelgpt.train.worker import read_run_config

    path = _torchrun_line(proc).split("--run-config ")[1]
    assert read_run_config(["--run-config", path]) == cfg and isinstance(cfg, ResolvedConfig)


def test_dry_run_with_machine_takes_its_gpus_per_node(no_gpu):
    proc = run_cli("train", "--size", "55", "--dry-run", "--machine", "a100-40gx8")
    assert proc.returncode == 0, proc.stderr
    assert "--nproc-per-node 8" in _torchrun_line(proc)
    assert "world size 8 = TP 2 x PP 1 x DP 4" in proc.stdout


def test_device_cuda_dry_run_without_a_gpu(no_gpu):
    proc = run_cli("train", "--size", "55", "--device", "cuda", "--dry-run")
    assert proc.returncode == 0, proc.stderr
    assert "device: cuda" in proc.stdout and "plan: skipped" in proc.stdout
    assert _torchrun_line(proc).startswith("torchrun command: none: ")


@pytest.mark.parametrize("args, needle", [
    ((*JOB, "model.depth=3"), "unknown key 'model.depth'"),
    ((*JOB, "--machine", "a100-40gx8", "model.depth=3"), "unknown key 'model.depth'"),
    ((*JOB, "--machine", "tpu"), "--machine must be one of"),
    ((*JOB, "--device", "cpu"), "model.recompute 'full' needs CUDA"),  # a CPU dry run keeps the CPU checks
    (("train", "--size", "tiny", "--device", "cpu", "--dry-run", "--machine", "a100-40gx8"), "a GPU machine"),
    (JOB[:-1], "model.recompute 'full' needs CUDA"),  # not a dry run: this machine runs it, and refuses
    # naming no GPUs, a dry run here is of a CPU job: refused, saying how a GPU job's dry run names them
    (("train", "--size", "h200-28b", "--dry-run"), "a dry run of a GPU job names its GPUs, --nproc-per-node N"),
    (("train", "--size", "55", "--device", "cuda"), "no CUDA GPU is visible"),
])
def test_bad_input_is_still_one_line(no_gpu, args, needle):
    check_one_line_error(run_cli(*args), needle)
