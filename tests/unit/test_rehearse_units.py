"""The rehearsal's pieces that need no process: which ranks it plays, where they sit in Megatron's
layout, the planner's per-stage prediction, its patches of torch.distributed (undone when it ends), and
`angelgpt rehearse`'s options (none of them `train`'s)."""

import pytest

from angelgpt.cli.rehearse import coordinates, default_ranks, stage_kind
from angelgpt.config import parse
from angelgpt.planner import MACHINES, plan_for
from tests.helpers import check_one_line_error, run_cli, run_cli_in_process


def test_default_ranks_are_rank_0_of_the_first_a_middle_and_the_last_stage():
    assert default_ranks(tp=2, pp=1, dp=4) == [0]
    assert default_ranks(tp=2, pp=2, dp=2) == [0, 4]
    assert default_ranks(tp=2, pp=4, dp=2) == [0, 4, 12]
    assert [stage_kind(p, 4) for p in range(4)] == ["first", "middle", "middle", "last"]
    assert stage_kind(0, 1) == "only"


def test_coordinates_follow_megatrons_tp_dp_pp_order():
    assert coordinates(0, 2, 2, 2) == {"tp_rank": 0, "dp_rank": 0, "pp_rank": 0}
    assert coordinates(3, 2, 2, 2) == {"tp_rank": 1, "dp_rank": 1, "pp_rank": 0}
    assert coordinates(5, 2, 2, 2) == {"tp_rank": 1, "dp_rank": 0, "pp_rank": 1}
    assert coordinates(5, 1, 4, 2) == {"tp_rank": 0, "dp_rank": 1, "pp_rank": 2}


@pytest.mark.parametrize("optimizer", ["zero_cache", "megatron"])
def test_the_plan_of_a_later_stage_holds_that_stages_parameters(optimizer):
    cfg = parse("55", None, ["parallel.pipeline_model_parallel_size=4", f"optim.optimizer={optimizer}",
                               "zero_cache.prefetch_cache_sub_group_rate=0.3", "model.recompute=full",
                               "zero_cache.accumulate_in_store=true", "zero_cache.offload_params=false",
                               "zero_cache.device_update_fraction=0.0", "zero_cache.cpu_adam=native"])
    hw = MACHINES["a100-40gx8"]
    first, middle, last = (plan_for(cfg, hw, 8, 4, pp_rank=p) for p in (0, 1, 3))
    assert plan_for(cfg, hw, 8, 4) == first  # the default is the first stage, as before
    # the first stage holds the word and position embeddings, the middle none, the last the output layer
    assert first.gpu_bytes["weights"] > last.gpu_bytes["weights"] > middle.gpu_bytes["weights"]


@pytest.mark.parametrize("option", [["--rehearse"], ["--gpu-mem", "40"], ["--host-mem", "1000"], ["--rank", "1"],
                                    ["--steps", "1"], ["--report", "r.json"]])
def test_train_takes_no_rehearsal_option(option):
    """A rehearsal is `angelgpt rehearse`; `train` refuses its options in one line naming the option."""
    proc = run_cli_in_process("train", "--size", "tiny", "--device", "cpu", *option)
    check_one_line_error(proc, f"angelgpt train: No such option: {option[0]}")


def test_train_takes_machine_for_a_dry_run_only():
    proc = run_cli_in_process("train", "--size", "tiny", "--device", "cpu", "--machine", "a100-40gx8")
    check_one_line_error(proc, "--machine applies to a dry run: add --dry-run (`angelgpt rehearse --machine")


@pytest.mark.subprocess
def test_rehearsal_refuses_a_rank_outside_the_world():
    check_one_line_error(run_cli("rehearse", "--size", "tiny", "--device", "cpu", "--nproc-per-node", "2",
                                 "--rank", "2"), "not a rank of a world of 2")


def test_rehearsed_sequence_parallel_reduce_scatter_gives_this_ranks_own_chunk(monkeypatch):
    """Under a torch whose fake group leaves a reduce-scatter's output as allocated (2.11's), Megatron's
    sequence-parallel reduce-scatter, bound to its own name when Megatron was imported, still gives this
    rank's chunk in a rehearsal: what a reduction over one rank gives, not any bytes."""
    import functools

    import torch
    import torch.distributed as dist
    from megatron.core.tensor_parallel import mappings
    from torch.distributed import distributed_c10d as c10d

    from angelgpt import parallel
    from angelgpt.parallel.cpu_schedules import on_cpu

    @functools.wraps(c10d.reduce_scatter_tensor)  # as torch decorates its own: with a `__wrapped__`
    def leaves_output(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
        return None

    for where in (c10d, dist, mappings):
        name = "dist_reduce_scatter_func" if where is mappings else "reduce_scatter_tensor"
        monkeypatch.setattr(where, name, leaves_output)
    with parallel.Rehearsal(rank=1, world_size=2).started(2, 1, on_gpu=False):
        full = torch.arange(8.0).view(4, 2)  # [s, h]: this rank's share is the second half of s
        with on_cpu():  # Megatron allocates the output on the current CUDA device
            assert torch.equal(mappings.reduce_scatter_to_sequence_parallel_region(full), full[2:])


def test_a_rehearsed_pipeline_receive_yields_values_like_real_ones(monkeypatch):
    """A fake group's receive writes nothing; in a rehearsal the buffer comes back filled with standard
    normal values: finite, not the bytes it held (NaN here), and not zeros, on which a later stage's GEMMs
    would run faster than on real activations."""
    import functools

    import torch
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    from angelgpt import parallel

    @functools.wraps(c10d.recv)  # as torch decorates its own: with a `__wrapped__`
    def writes_nothing(tensor, src=None, group=None, tag=0, group_src=None):
        return src

    for where in (c10d, dist):
        monkeypatch.setattr(where, "recv", writes_nothing)
    with parallel.Rehearsal(rank=1, world_size=2).started(1, 2, on_gpu=False):
        buffer = torch.full((4096,), float("nan"))
        dist.recv(buffer, src=0)
        assert torch.isfinite(buffer).all()
        assert 0.9 < buffer.std().item() < 1.1 and abs(buffer.mean().item()) < 0.1


def _collectives():
    """Every name a rehearsal replaces, with the object it holds: torch.distributed's and
    distributed_c10d's receives and reduce-scatter, and Megatron's tensor-parallel modules' own names
    for any of them."""
    import importlib

    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    from angelgpt.parallel.rehearsal import _BOUND_AT_IMPORT

    names = ("recv", "irecv", "reduce_scatter_tensor")
    found = {(where.__name__, n): getattr(where, n) for where in (dist, c10d) for n in names}
    originals = {id(getattr(c10d, n)) for n in names}
    for module in map(importlib.import_module, _BOUND_AT_IMPORT):
        found.update({(module.__name__, attr): value for attr, value in vars(module).items()
                      if id(value) in originals})
    return found


def test_a_rehearsal_ends_with_every_collective_it_replaced_the_original_again():
    """Within `started`, torch.distributed's collectives and Megatron's names for them are the
    rehearsal's; after it, each is the very object it was, the process group and Megatron's parallel
    state are gone, and a second rehearsal in this process plays its rank as the first did."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import mappings

    from angelgpt import parallel
    from angelgpt.parallel.cpu_schedules import on_cpu

    before = _collectives()
    assert ("megatron.core.tensor_parallel.mappings", "dist_reduce_scatter_func") in before

    def play(rank):
        with parallel.Rehearsal(rank=rank, world_size=4).started(2, 2, on_gpu=False):
            assert dist.get_world_size() == 4 and dist.get_rank() == rank
            assert all(_collectives()[key] is not value for key, value in before.items())
            buffer = torch.full((64,), float("nan"))
            dist.recv(buffer, src=0)
            full = torch.arange(8.0).view(4, 2)
            with on_cpu():
                chunk = mappings.reduce_scatter_to_sequence_parallel_region(full)
            return (parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_pipeline_model_parallel_rank(),
                    bool(torch.isfinite(buffer).all()), chunk)

    first = play(3)
    after = _collectives()
    assert after.keys() == before.keys() and all(after[key] is value for key, value in before.items())
    assert not dist.is_initialized() and not parallel_state.model_parallel_is_initialized()
    second = play(3)
    assert _collectives() == before and all(_collectives()[key] is value for key, value in before.items())
    assert first[:3] == second[:3] == (1, 1, True)
    assert torch.equal(first[3], second[3]) and torch.equal(first[3], torch.arange(8.0).view(4, 2)[2:])


def test_a_rehearsed_rank_takes_every_core_unless_told(monkeypatch):
    """A rehearsed rank has this host alone: its threads are every core, not the share of one of the
    target node's ranks; an OMP_NUM_THREADS the user set is kept."""
    import os

    from angelgpt.cli.rehearse import rank_env

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    assert rank_env(True, "zero_cache")["OMP_NUM_THREADS"] == "16"
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert rank_env(True, "zero_cache")["OMP_NUM_THREADS"] == "3"


def test_a_rehearsal_dry_run_prints_the_ranks_command():
    """`angelgpt rehearse` takes the job as `train` does (a dry run: the config and the rank's command,
    nothing run); a bad value is one line, exit 2."""
    job = ["--size", "tiny", "--device", "cpu", "--nproc-per-node", "2", "parallel.tensor_model_parallel_size=2",
           "--host-mem", "64", "--dry-run"]  # a fixed target: this machine's available memory moves
    proc = run_cli_in_process("rehearse", *job)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("rehearsal of a job of 1 x 2 ranks (TP 2 x PP 1 x DP 1)")
    assert "rehearsal command (one per rank): " in proc.stdout
    bad = run_cli_in_process("rehearse", "--size", "tiny", "--device", "cpu", "--steps", "x")
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1, bad.stderr


def test_rehearsal_errors_name_rehearses_options():
    job = ["--size", "tiny", "--device", "cpu", "--nproc-per-node", "2"]
    for args, needle in ((["--rank", "99"], "--rank 99 is not a rank of a world of 2"),
                         (["--steps", "0"], "--steps must be >= 1, got 0"),
                         (["--host-mem", "0"], "--host-mem must be > 0 GiB, got 0.0"),
                         (["--machine", "nope"], "--machine must be one of "),
                         (["--device", "tpu"], "--device must be 'cpu' or 'cuda', got 'tpu'")):
        check_one_line_error(run_cli_in_process("rehearse", *job, *args), needle)


@pytest.mark.parametrize("job, why", [
    (["--size", "55", "--nproc-per-node", "8", "--machine", "a100-40gx8"], "--machine a100-40gx8, is a GPU machine"),
    (["--size", "55", "--nproc-per-node", "8"], "model.recompute 'full' needs CUDA)")])
def test_a_gpu_job_is_refused_a_rehearsal_without_a_gpu_saying_what_works(job, why):
    """Without a GPU and without --device, a GPU job (a GPU target, or a config only CUDA runs) is not
    rehearsed on the CPU: one line says so and what works, before anything is planned or started."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: the job is rehearsed on it")
    proc = run_cli_in_process("rehearse", *job)
    check_one_line_error(proc, "this GPU job cannot be rehearsed without a GPU")
    line = proc.stderr.strip()
    assert why in line and "a machine with a GPU" in line and "--device cpu" in line
    assert "use 'none' on CPU" not in line
    assert proc.stdout == ""
    # its --device cpu form, chosen, is rehearsed on the CPU (here its dry run: the command, nothing run)
    tiny = run_cli_in_process("rehearse", "--size", "tiny", "--device", "cpu", "--nproc-per-node", "8",
                              "--machine", "a100-40gx8", "train.global_batch_size=32", "--dry-run")
    assert tiny.returncode == 0, tiny.stderr
    assert "rehearsal command (one per rank): " in tiny.stdout


def test_a_cpu_rehearsal_header_names_a_target_without_a_gpu():
    job = ["--size", "tiny", "--device", "cpu", "--nproc-per-node", "8", "train.global_batch_size=32",
           "--host-mem", "64", "--dry-run"]
    header = run_cli_in_process("rehearse", *job).stdout.splitlines()[0]
    assert header == ("rehearsal of a job of 1 x 8 ranks (TP 1 x PP 1 x DP 8) on a target node without a GPU, "
                      "64.0 GiB host per node; 3 steps on the CPU; ranks 0")
    with_gpus = run_cli_in_process("rehearse", *job, "--gpu-mem", "40").stdout.splitlines()[0]
    assert "on a target node of 8 GPUs of 40.0 GiB, 64.0 GiB host per node;" in with_gpus
    machine = run_cli_in_process("rehearse", *job, "--machine", "a100-40gx8").stdout.splitlines()[0]
    assert "on the target a100-40gx8: 39.4 GiB per GPU, 64.0 GiB host per node;" in machine


def test_a_ranks_report_reads_back_as_written_leaving_out_what_it_never_reached():
    """A rank's report as JSON and back is the same report; the parts the rank never reached
    (coordinates, config, measured) and the figures not taken are absent, not null; ran_out and error
    are always there."""
    import json

    from angelgpt.train.rank_report import Measured, RankReport, RanOut, Step, ZeroCacheMeasured

    ran = RankReport(4, "cuda", fits=True, coordinates={"tp_rank": 0, "pp_rank": 1, "dp_rank": 0},
                     config={"resolved": {"model.recompute": "full"}},
                     measured=Measured(10, 20, 30, 0, steps=[Step.of_record(
                         {"iteration": 1, "forward_backward_s": 0.5, "optimizer_step_s": 0.25, "loss": float("nan"),
                          "grad_norm": 1.0, "stepped": True, "zero_cache_profile": None})],
                         zero_cache=ZeroCacheMeasured({"host": 5}, 2, {"host": 5}, "zero_cache: ...")))
    stopped = RankReport(0, ran_out=RanOut("host memory", "used 3 GiB", by="the launcher's watcher"),
                         measured=Measured(7))
    for report in (ran, stopped, RankReport(1, error="the rehearsal exited with code 1")):
        assert RankReport.from_json(json.loads(json.dumps(report.to_json()))) == report
    assert ran.measured.steps[0].loss is None  # JSON has no NaN
    assert list(ran.to_json()) == ["rank", "fits", "ran_out", "error", "coordinates", "config", "device", "measured"]
    assert stopped.to_json() == {"rank": 0, "fits": False, "ran_out": {"resource": "host memory",
                                 "by": "the launcher's watcher", "message": "used 3 GiB"},
                                 "error": None, "device": "cpu", "measured": {"host_peak_rss_bytes": 7}}
