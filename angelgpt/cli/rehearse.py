"""`angelgpt rehearse`: a multi-GPU job rehearsed rank by rank on this one machine.

For each rank rehearsed (by default one of each pipeline stage kind: first, middle, last), one process
after another (angelgpt.train.rehearse) plays that rank of the real job's world under torch's fake
process group: its real model shard, optimizer placement and tiers and a few real steps, the GPU
allocator capped at the target's GPU memory and ZeRO-Cache's host budget the target node's host memory
per GPU. 'auto' is resolved once, for the target machine as the real job would, into the run config
every rank builds from. Each rank's measured peaks and step times are printed beside the planner's
prediction for its pipeline stage, and written as JSON. Exit 0 when every rehearsed rank ran, 2 when one ran out of the target's memory (one
line says what ran out), 1 when a rehearsal failed otherwise.

Host memory is held to the rank's budget: the target node's host memory over its ranks (on a CPU
rehearsal of a GPU target plus that GPU's memory, which the CPU holds here), never more than this
machine has available. A rank whose plan needs more host memory than its share is refused before
anything is built (one line naming both, exit 2, nothing written); a rank that outgrows its limit while
it runs is killed, children and all, by the launcher's watcher (run_within_host_budget: the rank's RSS
polled every 0.2 s), and the rehearsal stops there with one line and exit 2 (not this machine's
out-of-memory killer, minutes later).

No torch import at module level (the CLI stays quick).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

from angelgpt.cli.budget import gib3, host_budget, over_budget_message, run_within_host_budget
from angelgpt.cli.rehearsal_report import RankResult, exit_on_failure, gib, predicted, render_rank, this_machine
from angelgpt.system import GIB, git_commit, mem_available_bytes
from angelgpt.train.rank_report import Measured, RankReport, RanOut

if TYPE_CHECKING:
    from angelgpt.cli.prepare import Job
    from angelgpt.config import Config
    from angelgpt.planner import Machine


@dataclass(frozen=True)
class Options:
    """What `angelgpt rehearse` takes beside the job: the ranks to play (None: default_ranks), the steps
    each plays, the target (--machine, --gpu-mem, --host-mem; this machine's where not given), the JSON
    report's path, and a dry run (the config and the rank's command printed, nothing run)."""

    ranks: Optional[List[int]] = None
    steps: int = 3
    machine: Optional[str] = None
    gpu_mem: Optional[float] = None
    host_mem: Optional[float] = None
    report: Optional[str] = None
    dry_run: bool = False


def coordinates(rank: int, tp: int, pp: int, dp: int) -> dict:
    """Megatron's (tensor, data, pipeline) ranks of a global rank, its default order tp-cp-ep-dp-pp."""
    return {"tp_rank": rank % tp, "dp_rank": (rank // tp) % dp, "pp_rank": rank // (tp * dp)}


def stage_kind(pp_rank: int, pp: int) -> str:
    if pp == 1:
        return "only"
    return "first" if pp_rank == 0 else "last" if pp_rank == pp - 1 else "middle"


def default_ranks(tp: int, pp: int, dp: int) -> List[int]:
    """Rank 0 of the first pipeline stage, of one middle stage (the second) and of the last."""
    stages = [0] if pp == 1 else [0, pp - 1] if pp == 2 else [0, 1, pp - 1]
    return [p * tp * dp for p in stages]


def target_machine(zc, on_gpu: bool, gpus_per_node: int, machine: Optional[str], gpu_mem: Optional[float],
                   host_mem: Optional[float]):
    """The target node and this GPU's total bytes (0 without one). With --machine: that catalogue row,
    memory as given or the row's; else this machine's GPU as describe() reads it (its catalogue rates),
    with GPU memory and host memory per node as given or as read here (this GPU's total; MemAvailable,
    capped by a cgroup limit)."""
    import torch

    from angelgpt.planner import describe, machine_from
    from angelgpt.zero_cache.tiers import nvme_bytes

    if on_gpu:
        props = torch.cuda.get_device_properties(0)
        name, total = props.name, props.total_memory
    else:
        name, total = "no CUDA GPU", 0
    if machine:
        return machine_from(machine, gpu_mem_gib=gpu_mem, host_mem_gib=host_mem, gpus_per_node=gpus_per_node), total
    hw = describe(name, int(gpu_mem * GIB) if gpu_mem is not None else total, gpus_per_node,
                  int(host_mem * GIB) if host_mem is not None else mem_available_bytes(),
                  nvme_bytes(zc.nvme_path, zc.nvme_max_gib))
    sources = dict(hw.sources)
    for key, value in (("gpu_mem_gib", gpu_mem), ("host_mem_gib", host_mem)):
        if value is not None:
            sources[key] = f"given: {value:g} GiB by --{key.split('_')[0]}-mem (the target node)"
    return replace(hw, sources=sources), total


def rank_env(on_gpu: bool, optimizer: str) -> dict:
    """A rehearsed rank's environment: a worker's, as the only rank on this host (it has the host alone,
    so every core is its threads, OMP_NUM_THREADS where set: the CPU figures its plan here is of)."""
    from angelgpt.cli import launch

    return launch.worker_env(on_gpu, 1, optimizer)


@dataclass(frozen=True)
class _Setup:
    """A rehearsal settled before any rank runs: the target node (`hw`) and, on GPU, the target as this
    GPU plays it (`here`); the ranks' run config resolved once for the target (`resolved`, `line` its
    resolved settings) and each stage's plan on it (`plans`, by pipeline rank); the node's host memory
    per rank (`share_bytes`, where it comes from: `source`) and ZeRO-Cache's host budget per rank
    (`host_max_gib`); this GPU's total bytes and the cap of its allocator (0 and None on the CPU)."""

    job: "Job"
    ranks: List[int]
    steps: int
    machine: Optional[str]
    hw: "Machine"
    here: Optional["Machine"]
    resolved: "Config"
    line: str
    plans: Dict[int, Any]
    share_bytes: int
    source: str
    host_max_gib: float
    gpu_total: int
    gpu_cap: Optional[int]

    def where(self, rank: int) -> dict:
        job = self.job
        return coordinates(rank, job.cfg.parallel.tensor_model_parallel_size,
                           job.cfg.parallel.pipeline_model_parallel_size, job.data_parallel_size)


def rehearse(job: "Job", options: Options) -> None:
    """Rehearses the job's ranks one after another; raises SystemExit(2) when one ran out of memory (one
    line on stderr says which and what), SystemExit(1) when one failed otherwise."""
    from angelgpt.cli import launch

    setup = _settle(job, options)
    _print_header(setup)
    if options.dry_run:  # its run config stays, for the command it prints
        cmd = launch.rank_command(tempfile.mkdtemp(prefix="angelgpt-rehearse-"), setup.resolved, setup.hw)
        print(f"rehearsal command (one per rank): {launch.format_command(cmd)}")
        return
    results = []
    with tempfile.TemporaryDirectory(prefix="angelgpt-rehearse-") as tmp:
        cmd = launch.rank_command(tmp, setup.resolved, setup.hw)
        for rank in setup.ranks:
            result, stopped = _play(setup, rank, cmd, os.path.join(tmp, f"rank{rank}.json"))
            results.append(result)
            print(render_rank(result), flush=True)
            if stopped:  # the rest would be held to the same budget: stop here
                break
    summary = _summary(setup, results)
    if options.report:
        os.makedirs(os.path.dirname(os.path.abspath(options.report)), exist_ok=True)
        with open(options.report, "w") as fh:
            json.dump(summary, fh, indent=1, default=str)
        print(f"rehearsal report written to {options.report}", flush=True)
    exit_on_failure([r for r in results if not r.report.fits])
    print("rehearsal: every rehearsed rank fits", flush=True)


def _ranks(job: "Job", options: Options) -> List[int]:
    """The ranks to rehearse, the options checked (ConfigError: one line naming the option; --machine is
    the job's, checked by prepare)."""
    from angelgpt.config import ConfigError

    for name, value in (("--gpu-mem", options.gpu_mem), ("--host-mem", options.host_mem)):
        if value is not None and not value > 0:
            raise ConfigError(f"{name} must be > 0 GiB, got {value}")
    if options.steps < 1:
        raise ConfigError(f"--steps must be >= 1, got {options.steps}")
    cfg, world = job.cfg, job.world_size
    ranks = list(options.ranks) if options.ranks else default_ranks(
        cfg.parallel.tensor_model_parallel_size, cfg.parallel.pipeline_model_parallel_size, job.data_parallel_size)
    bad = [r for r in ranks if not 0 <= r < world]
    if bad:
        raise ConfigError(f"--rank {bad[0]} is not a rank of a world of {world} "
                          f"({job.nnodes} x {job.nproc_per_node}): 0 to {world - 1}")
    return ranks


def _settle(job: "Job", options: Options) -> _Setup:
    """The target, the ranks' run config resolved for it and each stage's plan; a rank whose plan needs
    more host memory than its share of the node's is refused here, before anything is built or written."""
    from angelgpt.config import ConfigError
    from angelgpt.planner import plan_for, resolve_config, resolved_line
    from angelgpt.planner.plan import CUDA_CONTEXT
    from angelgpt.train.rehearse import played_overrides

    ranks = _ranks(job, options)
    cfg, on_gpu, nproc = job.cfg, job.on_gpu, job.nproc_per_node
    hw, gpu_total = target_machine(cfg.zero_cache, on_gpu, nproc, options.machine, options.gpu_mem, options.host_mem)
    here = None
    if on_gpu:  # this machine's catalogue rates, to plan the rank as it runs here
        import torch

        from angelgpt.planner import describe, rehearsing_machine

        props = torch.cuda.get_device_properties(0)
        here = rehearsing_machine(hw, describe(props.name, props.total_memory, 1, 0, 0))
    # ZeRO-Cache's host budget per rank: the target node's host memory over its GPUs (or less, if set)
    share = hw.host_mem_gib / nproc
    host_max = share if cfg.zero_cache.host_max_gib is None else min(cfg.zero_cache.host_max_gib, share)
    # the ranks' config (the job's, as a rehearsed rank plays it), resolved once here for the target
    played = job.parse(played_overrides(options.steps))
    played = replace(played, zero_cache=replace(played.zero_cache, host_max_gib=host_max))
    resolved, _ = resolve_config(played, hw, nproc, job.nnodes, on_gpu)
    tp, pp, dp = cfg.parallel.tensor_model_parallel_size, cfg.parallel.pipeline_model_parallel_size, \
        job.data_parallel_size
    plans = {p: plan_for(resolved, hw, nproc, job.nnodes, pp_rank=p)
             for p in sorted({coordinates(r, tp, pp, dp)["pp_rank"] for r in ranks})}
    share_bytes = int(share * GIB)
    source = (f"--host-mem {options.host_mem:g} GiB" if options.host_mem is not None else
              f"--machine {options.machine}'s {hw.host_mem_gib:g} GiB" if options.machine else
              f"this machine's available {hw.host_mem_gib:.1f} GiB") + f" per node over {nproc} ranks"
    for rank in ranks:
        p_rank = coordinates(rank, tp, pp, dp)["pp_rank"]
        need = sum(plans[p_rank].host_bytes.values())
        if need > share_bytes:
            raise ConfigError(f"rehearsal: the plan of rank {rank} ({stage_kind(p_rank, pp)} stage) needs "
                              f"{gib3(need)} of host memory, over its budget of {gib3(share_bytes)} ({source}); "
                              f"nothing was rehearsed")
    gpu_cap = min(int(hw.gpu_mem_gib * GIB) - CUDA_CONTEXT, gpu_total) if on_gpu else None
    return _Setup(job, ranks, options.steps, options.machine, hw, here, resolved, resolved_line(played, resolved),
                  plans, share_bytes, source, host_max, gpu_total, gpu_cap)


def _print_header(s: _Setup) -> None:
    """What is rehearsed, of what target, on what here; the resolved settings."""
    job, hw, cfg = s.job, s.hw, s.job.cfg
    budget = f" ({gib(s.host_max_gib * GIB)} ZeRO-Cache host budget per rank)" \
        if cfg.optim.spec.uses_zero_cache_settings else ""
    # the target: --machine's, or the GPU read here, or a node of --gpu-mem GPUs, or one without a GPU
    target = (f"the target {hw.name}: {hw.gpu_mem_gib:.1f} GiB per GPU" if job.on_gpu or s.machine else
              f"a target node of {job.nproc_per_node} GPUs of {hw.gpu_mem_gib:.1f} GiB" if hw.gpu_mem_gib else
              "a target node without a GPU")
    tp, pp = cfg.parallel.tensor_model_parallel_size, cfg.parallel.pipeline_model_parallel_size
    print(f"rehearsal of a job of {job.nnodes} x {job.nproc_per_node} ranks (TP {tp} x PP {pp} x DP "
          f"{job.data_parallel_size}) on {target}, "
          f"{hw.host_mem_gib:.1f} GiB host per node{budget}; {s.steps} steps on "
          f"{'this GPU, its allocator capped at ' + gib(s.gpu_cap) if job.on_gpu else 'the CPU'}; ranks "
          f"{', '.join(str(r) for r in s.ranks)}", flush=True)
    if job.on_gpu and int(hw.gpu_mem_gib * GIB) > s.gpu_total:
        print(f"angelgpt: warning: the target's GPU memory ({hw.gpu_mem_gib:.1f} GiB) is more than this GPU has "
              f"({gib(s.gpu_total)}): the rehearsal is capped by this GPU", file=sys.stderr, flush=True)
    if cfg.checkpoint.save or cfg.checkpoint.load:
        print("a rehearsal neither reads nor writes checkpoints (checkpoint.save/load ignored)")
    if s.line:
        print(s.line, flush=True)


def _play(s: _Setup, rank: int, cmd: List[str], path: str) -> Tuple[RankResult, bool]:
    """(its result, whether the launcher's watcher stopped it): `rank` played by its own process
    (`cmd`, which writes its report to `path`), held to its host memory budget."""
    from angelgpt.planner import plan_for
    from angelgpt.train.lifetime import agent_preexec
    from angelgpt.train.rehearse import REHEARSE_ENV

    job, hw, on_gpu = s.job, s.hw, s.job.on_gpu
    where = s.where(rank)
    kind = stage_kind(where["pp_rank"], job.cfg.parallel.pipeline_model_parallel_size)
    print(f"rehearsing rank {rank} ({kind} stage) ...", flush=True)
    env = rank_env(on_gpu, job.cfg.optim.optimizer)
    env.update({"RANK": str(rank), "WORLD_SIZE": str(job.world_size), "LOCAL_RANK": str(rank % job.nproc_per_node),
                "LOCAL_WORLD_SIZE": str(job.nproc_per_node), "GROUP_RANK": str(rank // job.nproc_per_node),
                REHEARSE_ENV: json.dumps({"rank": rank, "world_size": job.world_size, "gpu_cap_bytes": s.gpu_cap,
                                          "report": path})})
    limit, budget, why = host_budget(s.share_bytes, s.source, on_gpu, int(hw.gpu_mem_gib * GIB), mem_available_bytes())
    proc = run_within_host_budget(cmd, limit, env=env, preexec_fn=agent_preexec())
    report = _rank_report(rank, on_gpu, proc, path, over_budget_message(proc.over_bytes, limit, budget, why)
                          if proc.over_bytes is not None else None)
    for text in proc.stderr.splitlines():  # angelgpt's own warnings; the rest only on failure
        if text.startswith("angelgpt: ") or (report.error and not report.ran_out):
            print(text, file=sys.stderr)
    if report.coordinates is not None and report.coordinates != where:
        print(f"angelgpt: warning: rank {rank} played {report.coordinates}, expected {where}", file=sys.stderr)
    here_plan = plan_for(s.resolved, s.here, job.nproc_per_node, job.nnodes, pp_rank=where["pp_rank"]) \
        if s.here else None
    result = RankResult(report, stage=kind, coordinates=where, node_rank=rank // job.nproc_per_node,
                        gpu_cap_bytes=s.gpu_cap, host_budget_bytes=int(s.host_max_gib * GIB),
                        host_share_bytes=s.share_bytes, host_limit_bytes=limit, host_limit=why,
                        host_watched_peak_rss_bytes=proc.peak_rss_bytes, cpu_threads=int(env["OMP_NUM_THREADS"]),
                        exit_code=proc.returncode,
                        predicted=predicted(s.plans[where["pp_rank"]], here_plan, where["pp_rank"], hw.gpu_tflops,
                                            s.here.gpu_tflops if s.here else None))
    return result, proc.over_bytes is not None


def _rank_report(rank: int, on_gpu: bool, proc, path: str, over: Optional[str]) -> RankReport:
    """The report the rank wrote to `path`, or what the launcher knows of it: that its watcher stopped it
    (`over`, its message), that it was killed, or its exit code."""
    device = "cuda" if on_gpu else "cpu"
    if over is not None:
        return RankReport(rank, device, ran_out=RanOut("host memory", over, by="the launcher's watcher"),
                          measured=Measured(proc.peak_rss_bytes))
    if os.path.isfile(path):
        with open(path) as fh:
            return RankReport.from_json(json.load(fh))
    if proc.returncode == -9:
        return RankReport(rank, device, ran_out=RanOut("host memory", "the rehearsal was killed by SIGKILL, most "
                                                       "likely by the kernel's out-of-memory killer (this machine's "
                                                       "host memory)"))
    return RankReport(rank, device, error=f"the rehearsal exited with code {proc.returncode}")


def _summary(s: _Setup, results: List[RankResult]) -> dict:
    """The rehearsal's JSON report; the planner's communication time printed beside it."""
    from angelgpt.cli import launch
    from angelgpt.planner import plan_for

    job, cfg = s.job, s.job.cfg
    network = plan_for(s.resolved, s.hw, job.nproc_per_node, job.nnodes).step_s.get("network", 0.0)
    communication = {"network_s": network, "predicted": True,
                     "what": "the planner's data-parallel collective time per step left exposed beyond compute, "
                             "for the full job; tensor- and pipeline-parallel communication are not modelled, "
                             "and a rehearsal moves no data"}
    print(f"communication (predicted by the planner for the full job, not measured): {network:.4f} s per step "
          f"of data-parallel collectives exposed beyond compute; TP and PP communication not modelled", flush=True)
    return {"command": launch.format_command(["angelgpt", *sys.argv[1:]]), "commit": git_commit(),
            "rehearsed_on": this_machine(job.on_gpu),
            "rehearsal": {"nnodes": job.nnodes, "nproc_per_node": job.nproc_per_node, "world_size": job.world_size,
                          "tensor_model_parallel_size": cfg.parallel.tensor_model_parallel_size,
                          "pipeline_model_parallel_size": cfg.parallel.pipeline_model_parallel_size,
                          "data_parallel_size": job.data_parallel_size, "steps": s.steps,
                          "device": "cuda" if job.on_gpu else "cpu",
                          "collectives": "fake (no data moved; losses meaningless)"},
            "target": asdict(s.hw), "resolved": s.line, "fits": all(r.report.fits for r in results),
            "ranks": [r.to_json() for r in results], "predicted_communication": communication}
