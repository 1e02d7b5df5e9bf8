"""Every bad input: exit code 2, one line on stderr naming the problem, no traceback, nothing launched."""

import pytest

from tests.helpers import check_one_line_error, dry_run, run_cli, run_config_in

CASES = {
    "unknown preset": (["train", "--size", "nope"], "unknown preset 'nope'"),
    "unknown key": (["train", "--size", "tiny", "model.depth=3"], "unknown key 'model.depth'"),
    "unknown bare key": (["train", "--size", "tiny", "depth=3"], "unknown key 'depth'"),
    "wrong type": (["train", "--size", "tiny", "model.num_layers=abc"], "model.num_layers: expected int"),
    "heads not dividing hidden": (["train", "--size", "tiny", "model.hidden_size=65"],
                                  "must divide model.hidden_size"),
    "tp not dividing heads": (["train", "--size", "tiny", "parallel.tensor_model_parallel_size=3"],
                              "tensor_model_parallel_size (3) must divide model.num_attention_heads"),
    "world size vs tp x pp": (["train", "--size", "tiny", "--device", "cpu", "--nproc-per-node", "3",
                               "parallel.tensor_model_parallel_size=2"], "world size 3 is not divisible"),
    "micro batch vs global batch": (["train", "--size", "tiny", "train.micro_batch_size=3"],
                                    "micro_batch_size (3) must divide train.global_batch_size"),
    "micro batch x dp vs global batch": (["train", "--size", "tiny", "--device", "cpu", "--nproc-per-node", "2",
                                          "train.micro_batch_size=8"], "must be divisible by train.micro_batch_size"),
    "missing file": (["train", "--config", "/nonexistent/x.yaml"], "config file not found"),
    "unknown option": (["train", "--bogus"], "No such option: --bogus"),
    "bad device": (["train", "--size", "tiny", "--device", "gpu"], "--device must be 'cpu' or 'cuda'"),
    "compact moments with megatron": (["train", "--size", "tiny", "optim.exp_avg_dtype=bf16"],
                                      "optim.exp_avg_dtype is honoured by optim.optimizer 'zero_cache' only"),
    "stop grace not positive": (["train", "--size", "tiny", "checkpoint.stop_grace_s=0"],
                                "checkpoint.stop_grace_s must be > 0"),
    "wall-clock limit not positive": (["train", "--size", "tiny", "train.exit_duration_mins=-1"],
                                      "train.exit_duration_mins must be > 0"),
    "update slice not whole fp8 blocks": (["train", "--size", "tiny", "zero_cache.update_slice_numel=1000"],
                                          "zero_cache.update_slice_numel must be a positive multiple of 256"),
    "wall-clock limit not a number": (["train", "--size", "tiny", "train.exit_duration_mins=soon"],
                                      "train.exit_duration_mins"),
    "missing data": (["train", "--size", "tiny", "--device", "cpu", "data.paths=/nonexistent/ds"],
                     "/nonexistent/ds.bin not found"),
}


@pytest.mark.subprocess
@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input(case):
    args, needle = CASES[case]
    check_one_line_error(run_cli(*args), needle)


@pytest.mark.subprocess
def test_malformed_yaml(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  num_layers: [1,\n")
    check_one_line_error(run_cli("train", "--config", bad), "malformed YAML")


@pytest.mark.subprocess
def test_yaml_not_a_mapping(tmp_path):
    bad = tmp_path / "list.yaml"
    bad.write_text("- 1\n- 2\n")
    check_one_line_error(run_cli("train", "--config", bad), "must hold a mapping")


@pytest.mark.subprocess
def test_dry_run_prints_command_writes_its_run_config_and_exits_0(tmp_path):
    """The command printed names the run config the dry run wrote: the config printed, resolved."""
    import yaml

    proc, cmd = dry_run(tmp_path, "--size", "tiny", "--device", "cpu", "--nproc-per-node", "2", "num_layers=3")
    assert proc.returncode == 0, proc.stderr
    assert "num_layers: 3" in proc.stdout
    line = next(l for l in proc.stdout.splitlines() if l.startswith("torchrun command: "))
    assert "-m torch.distributed.run --nproc-per-node 2 --standalone --signals-to-handle SIGHUP,SIGQUIT -m angelgpt.train.worker --run-config " in line
    path = run_config_in(cmd)
    assert cmd[-2:] == ["--run-config", path] and path.startswith(str(tmp_path))
    assert f"run config: {path} " in proc.stdout
    written = yaml.safe_load(open(path))
    assert written["model"]["num_layers"] == 3 and written["train"]["device"] == "cpu"
    printed = yaml.safe_load(proc.stdout.split("\nparams: ")[0])
    assert written == printed


@pytest.mark.subprocess
def test_help_does_not_import_torch_distributed():
    import subprocess
    import sys

    code = ("import sys; from angelgpt.cli.app import app; "
            "print('torch.distributed' in sys.modules, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.split()
    assert out == ["False", "False"]


def test_worker_env_gives_zero_cache_several_hardware_queues(monkeypatch):
    """One hardware work queue (Megatron's CUDA_DEVICE_MAX_CONNECTIONS=1) would put the compute kernels
    behind ZeRO-Cache's transfer-stream waits; Megatron's optimizers keep Megatron's setting."""
    from angelgpt.cli import launch

    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in launch.worker_env(True, 1, "zero_cache")
    assert launch.worker_env(True, 1, "megatron")["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
    assert launch.queue_warning(launch.worker_env(True, 1, "zero_cache"), True, "zero_cache") is None
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")  # the user's (or an image's) setting is kept, and named
    env = launch.worker_env(True, 1, "zero_cache")
    assert env["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
    assert "CUDA_DEVICE_MAX_CONNECTIONS=1" in launch.queue_warning(env, True, "zero_cache")
    assert launch.queue_warning(env, True, "megatron") is None and launch.queue_warning(env, False, "zero_cache") is None


def test_workers_share_torchruns_store_unless_restarts_are_asked_for(monkeypatch):
    """A store of the workers' own listens on a port torchrun found free and let go, which a job starting
    beside this one may take first (EADDRINUSE before any step); they keep one only where --max-restarts
    needs it (pytorch/pytorch#135712: a shared store hands a restarted worker the previous addresses)."""
    from angelgpt.cli import launch

    monkeypatch.delenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", raising=False)
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in launch.worker_env(False, 2, "zero_cache")
    assert launch.worker_env(False, 2, "zero_cache", max_restarts=1)["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
