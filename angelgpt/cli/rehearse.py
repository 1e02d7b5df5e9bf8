"""`angelgpt train --rehearse`: a multi-GPU job rehearsed rank by rank on this one machine.

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

import contextlib
import contextvars
import json
import os
import sys
import tempfile
from dataclasses import asdict, replace
from statistics import median
from typing import List, Optional

from angelgpt.cli.budget import gib3, host_budget, over_budget_message, run_within_host_budget
from angelgpt.system import GIB, git_commit, mem_available_bytes


# the options a rehearsal's messages name: `angelgpt train --rehearse`'s, or within `as_command("rehearse")`
# (`angelgpt rehearse`, which runs train's code) its own
OPTIONS = {"rehearse": {"rank": "--rank", "steps": "--steps"},
           "train": {"rank": "--rehearse-rank", "steps": "--rehearse-steps"}}
_COMMAND = contextvars.ContextVar("angelgpt_rehearsal_command", default="train")


@contextlib.contextmanager
def as_command(name: str):
    """Within it, a rehearsal's messages name the options of command `name` (a key of OPTIONS)."""
    token = _COMMAND.set(name)
    try:
        yield
    finally:
        _COMMAND.reset(token)


def refuse_without_gpu(cfg, machine: Optional[str]) -> None:
    """A GPU job (its target a catalogue GPU machine, or a config the CPU cannot run) rehearsed where no GPU
    is visible, its device not chosen: refused in one line saying what works. Rehearsing on the CPU is
    chosen with --device cpu, for a model the CPU can hold."""
    from angelgpt.config import ConfigError

    if machine is not None:
        why = f"its target, --machine {machine}, is a GPU machine"
    else:
        try:
            cfg.check_device(on_gpu=False)
            return
        except ConfigError as exc:  # e.g. "model.recompute 'full' needs CUDA (...)": the setting only
            why = str(exc).split(" (")[0].split(";")[0]
    raise ConfigError(f"this GPU job cannot be rehearsed without a GPU, and none is visible here ({why}): "
                      f"rehearse it on a machine with a GPU, or rehearse its --device cpu form, a model the CPU "
                      f"can hold (e.g. --size tiny --device cpu)")


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


def _gib(b) -> str:
    b = b or 0
    return f"{b / 2 ** 20:.2f} MiB" if 0 < b < GIB // 100 else f"{b / GIB:.2f} GiB"


def _predicted(p, here, pp_rank: int, target_tflops: float, here_tflops: Optional[float]) -> dict:
    """The planner's numbers for the rank on the target (`p`), plus, from `here` (the plan of the same
    rank on the rehearsing machine, planner.rehearsing_machine; None on CPU) its step there with the
    collectives left out, which a rehearsal fakes: what the measured step (forward-backward and optimizer
    step) is compared with. compute_here_s: that plan's compute alone, the target's at this GPU's rate."""
    host_rank = sum(p.host_bytes.values())
    step_here = {k: v for k, v in here.step_s.items() if k != "network"} if here is not None else None
    return {"for": f"data-parallel rank 0 of pipeline stage {pp_rank} (the planner's per-rank model)",
            "system": p.system, "fits": p.fits, "gpu_bytes": p.gpu_bytes, "gpu_total_bytes": p.gpu_total,
            "host_bytes": p.host_bytes, "host_per_rank_bytes": host_rank, "host_node_bytes": p.host_total,
            "margin_bytes": p.margin, "step_s": p.step_s, "step_time_s": p.step_time_s,
            "bottleneck": p.bottleneck, "rate": p.rate, "target_gpu_tflops": target_tflops,
            "here_gpu_tflops": here_tflops,
            "compute_here_s": step_here["compute"] if step_here else None,
            "step_here": step_here, "step_here_s": round(sum(step_here.values()), 4) if step_here else None}


def rank_env(on_gpu: bool, optimizer: str) -> dict:
    """A rehearsed rank's environment: a worker's, as the only rank on this host (it has the host alone,
    so every core is its threads, OMP_NUM_THREADS where set: the CPU figures its plan here is of)."""
    from angelgpt.cli import launch

    return launch.worker_env(on_gpu, 1, optimizer)


def _median_after_first(values: List[float]) -> Optional[float]:
    values = [v for v in values if v is not None]
    if not values:
        return None
    return median(values[1:] if len(values) > 1 else values)


def render_rank(r: dict) -> str:
    c, m, p = r["coordinates"], r.get("measured") or {}, r.get("predicted") or {}
    on_gpu = r.get("device") == "cuda"
    verdict = "fits" if r.get("fits") else (f"RAN OUT of {r['ran_out']['resource']}" if r.get("ran_out")
                                            else "FAILED")
    lines = [f"rank {r['rank']} (node {r['node_rank']}, {r['stage']} stage: pp {c['pp_rank']}, tp {c['tp_rank']}, "
             f"dp {c['dp_rank']}) on {r.get('device', '?')}: {verdict}"]
    if on_gpu:
        lines.append(f"  GPU   peak {_gib(m.get('gpu_peak_allocated_bytes'))} allocated, "
                     f"{_gib(m.get('gpu_peak_reserved_bytes'))} reserved, cap {_gib(r.get('gpu_cap_bytes'))}"
                     f"   | predicted {_gib(p.get('gpu_total_bytes'))}")
    else:
        lines.append(f"  GPU   none (a CPU rehearsal: host memory is what is measured)   | predicted for a GPU rank "
                     f"{_gib(p.get('gpu_total_bytes'))}")
    zc = m.get("zero_cache")
    tier = (f"; ZeRO-Cache host tier {_gib(zc['tier_bytes'].get('host'))} ({_gib(zc['host_pinned_bytes'])} pinned)"
            if zc else "")
    rss, share = m.get("host_peak_rss_bytes") or 0, r.get("host_share_bytes") or 0
    over = " (above the node's host memory per rank)" if share and rss > share else ""
    lines.append(f"  host  peak RSS {_gib(rss)}{over}{tier}; node's host memory per rank {_gib(share)}   "
                 f"| predicted {_gib(p.get('host_per_rank_bytes'))} per rank")
    steps = m.get("steps") or []
    if steps:
        fb = _median_after_first([s["forward_backward_s"] for s in steps])
        opt = _median_after_first([s["optimizer_step_s"] for s in steps])
        step = _median_after_first([s["forward_backward_s"] + s["optimizer_step_s"] for s in steps])
        which = f"median of steps 2-{len(steps)}" if len(steps) > 2 else f"step {len(steps)}"
        here = p.get("step_here_s")
        here = (f"step {here:.4f} s on this machine (compute {p['step_here']['compute']:.4f}), "
                if here is not None else "")
        lines.append(f"  step  {step:.4f} s measured (forward-backward {fb:.4f}, optimizer step {opt:.4f}; "
                     f"{which}; collectives faked)   | predicted {here}compute "
                     f"{p.get('step_s', {}).get('compute', 0):.4f} s, step {p.get('step_time_s', 0):.4f} s on the target")
        prof = steps[-1].get("zero_cache_profile")
        if prof:
            busy = ", ".join(f"{k[:-3]} {v:.1f}" for k, v in prof.items() if k.endswith("_ms") and v
                             and not k.startswith("exposed_"))
            exposed = ", ".join(f"{k[8:-3]} {v:.1f}" for k, v in prof.items() if k.startswith("exposed_") and v)
            lines.append(f"  zero_cache profile (last step, ms): {busy or 'nothing'}; exposed: {exposed or 'none'}")
    if zc:
        lines.append(f"  {zc['summary']}")
    if r.get("ran_out"):
        lines.append(f"  ran out: {r['ran_out']['message']}")
    if r.get("error"):
        lines.append(f"  error: {r['error']}")
    return "\n".join(lines)


def _this_machine(on_gpu: bool) -> dict:
    """What the rehearsal ran on: GPU name and memory, host memory and CPUs, host name."""
    import platform

    import torch

    out = {"host": platform.node(), "cpus": os.cpu_count(), "host_mem_available_bytes": mem_available_bytes()}
    if on_gpu:
        props = torch.cuda.get_device_properties(0)
        out.update(gpu=props.name, gpu_total_bytes=props.total_memory, torch=torch.__version__)
    return out


def rehearse(cfg, size: Optional[str], config: Optional[str], extra: List[str], on_gpu: bool, nproc_per_node: int,
             nnodes: int, ranks: Optional[List[int]], steps: int, gpu_mem: Optional[float], host_mem: Optional[float],
             machine: Optional[str], report_path: Optional[str], dry_run: bool) -> None:
    """Rehearses the ranks one after another; raises SystemExit(2) when one ran out of memory (one line
    on stderr says which and what), SystemExit(1) when one failed otherwise."""
    from angelgpt.cli import launch
    from angelgpt.config import ConfigError, parse
    from angelgpt.planner import MACHINES, plan_for, resolve_config, resolved_line
    from angelgpt.planner.plan import CUDA_CONTEXT
    from angelgpt.train.lifetime import agent_preexec
    from angelgpt.train.rehearse import REHEARSE_ENV, played_overrides

    if machine is not None and machine not in MACHINES:
        raise ConfigError(f"--machine must be one of {', '.join(MACHINES)}, got '{machine}'")
    for name, value in (("--gpu-mem", gpu_mem), ("--host-mem", host_mem)):
        if value is not None and not value > 0:
            raise ConfigError(f"{name} must be > 0 GiB, got {value}")
    names = OPTIONS[_COMMAND.get()]
    if steps < 1:
        raise ConfigError(f"{names['steps']} must be >= 1, got {steps}")
    world = nproc_per_node * nnodes
    tp, pp = cfg.parallel.tensor_model_parallel_size, cfg.parallel.pipeline_model_parallel_size
    dp = cfg.data_parallel_size(world)
    ranks = list(ranks) if ranks else default_ranks(tp, pp, dp)
    bad = [r for r in ranks if not 0 <= r < world]
    if bad:
        raise ConfigError(f"{names['rank']} {bad[0]} is not a rank of a world of {world} "
                          f"({nnodes} x {nproc_per_node}): 0 to {world - 1}")

    hw, gpu_total = target_machine(cfg.zero_cache, on_gpu, nproc_per_node, machine, gpu_mem, host_mem)
    here = None
    if on_gpu:  # this machine's catalogue rates, to plan the rank as it runs here
        import torch

        from angelgpt.planner import describe, rehearsing_machine

        props = torch.cuda.get_device_properties(0)
        here = rehearsing_machine(hw, describe(props.name, props.total_memory, 1, 0, 0))
    # ZeRO-Cache's host budget per rank: the target node's host memory over its GPUs (or less, if set)
    share = hw.host_mem_gib / nproc_per_node
    zc = cfg.zero_cache
    host_max = share if zc.host_max_gib is None else min(zc.host_max_gib, share)
    # the ranks' config (the job's, as a rehearsed rank plays it), resolved once here for the target
    played = parse(size, config, extra + played_overrides(steps))
    played = replace(played, zero_cache=replace(played.zero_cache, host_max_gib=host_max))
    resolved, _ = resolve_config(played, hw, nproc_per_node, nnodes, on_gpu)
    line = resolved_line(played, resolved)
    # each rank's plan, by pipeline stage; one whose host memory is more than the rank's share of the
    # node's is refused here, before anything is built or written
    plans = {p: plan_for(resolved, hw, nproc_per_node, nnodes, pp_rank=p)
             for p in sorted({coordinates(r, tp, pp, dp)["pp_rank"] for r in ranks})}
    share_bytes = int(share * GIB)
    source = (f"--host-mem {host_mem:g} GiB" if host_mem is not None else
              f"--machine {machine}'s {hw.host_mem_gib:g} GiB" if machine else
              f"this machine's available {hw.host_mem_gib:.1f} GiB") + f" per node over {nproc_per_node} ranks"
    for rank in ranks:
        p_rank = coordinates(rank, tp, pp, dp)["pp_rank"]
        need = sum(plans[p_rank].host_bytes.values())
        if need > share_bytes:
            raise ConfigError(f"rehearsal: the plan of rank {rank} ({stage_kind(p_rank, pp)} stage) needs "
                              f"{gib3(need)} of host memory, over its budget of {gib3(share_bytes)} ({source}); "
                              f"nothing was rehearsed")
    gpu_cap = None
    if on_gpu:
        gpu_cap = min(int(hw.gpu_mem_gib * GIB) - CUDA_CONTEXT, gpu_total)
    budget = f" ({_gib(host_max * GIB)} ZeRO-Cache host budget per rank)" if cfg.optim.spec.uses_zero_cache_settings \
        else ""
    target = (f"the target {hw.name}: {hw.gpu_mem_gib:.1f} GiB per GPU" if on_gpu or machine else  # a GPU read here
              f"a target node of {nproc_per_node} GPUs of {hw.gpu_mem_gib:.1f} GiB" if hw.gpu_mem_gib else
              "a target node without a GPU")
    print(f"rehearsal of a job of {nnodes} x {nproc_per_node} ranks (TP {tp} x PP {pp} x DP {dp}) on {target}, "
          f"{hw.host_mem_gib:.1f} GiB host per node{budget}; {steps} steps on "
          f"{'this GPU, its allocator capped at ' + _gib(gpu_cap) if on_gpu else 'the CPU'}; ranks "
          f"{', '.join(str(r) for r in ranks)}", flush=True)
    if on_gpu and int(hw.gpu_mem_gib * GIB) > gpu_total:
        print(f"angelgpt: warning: the target's GPU memory ({hw.gpu_mem_gib:.1f} GiB) is more than this GPU has "
              f"({_gib(gpu_total)}): the rehearsal is capped by this GPU", file=sys.stderr, flush=True)
    if cfg.checkpoint.save or cfg.checkpoint.load:
        print("a rehearsal neither reads nor writes checkpoints (--save/--load ignored)")
    if line:
        print(line, flush=True)
    if dry_run:  # its run config stays, for the command it prints
        cmd = launch.rank_command(tempfile.mkdtemp(prefix="angelgpt-rehearse-"), resolved, hw)
        print(f"rehearsal command (one per rank): {launch.format_command(cmd)}")
        return

    results, failed = [], []
    with tempfile.TemporaryDirectory(prefix="angelgpt-rehearse-") as tmp:
        cmd = launch.rank_command(tmp, resolved, hw)
        for rank in ranks:
            where = coordinates(rank, tp, pp, dp)
            kind = stage_kind(where["pp_rank"], pp)
            print(f"rehearsing rank {rank} ({kind} stage) ...", flush=True)
            path = os.path.join(tmp, f"rank{rank}.json")
            env = rank_env(on_gpu, cfg.optim.optimizer)
            env.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank % nproc_per_node),
                        "LOCAL_WORLD_SIZE": str(nproc_per_node), "GROUP_RANK": str(rank // nproc_per_node),
                        REHEARSE_ENV: json.dumps({"rank": rank, "world_size": world, "gpu_cap_bytes": gpu_cap,
                                                  "report": path})})
            limit, budget, why = host_budget(share_bytes, source, on_gpu, int(hw.gpu_mem_gib * GIB),
                                             mem_available_bytes())
            proc = run_within_host_budget(cmd, limit, env=env, preexec_fn=agent_preexec())
            report = json.load(open(path)) if os.path.isfile(path) and proc.over_bytes is None else None
            if proc.over_bytes is not None:
                report = {"rank": rank, "fits": False, "device": "cuda" if on_gpu else "cpu", "error": None,
                          "ran_out": {"resource": "host memory", "by": "the launcher's watcher",
                                      "message": over_budget_message(proc.over_bytes, limit, budget, why)},
                          "measured": {"host_peak_rss_bytes": proc.peak_rss_bytes}}
            elif report is None:
                killed = proc.returncode == -9
                report = {"rank": rank, "fits": False, "device": "cuda" if on_gpu else "cpu",
                          "ran_out": {"resource": "host memory", "message": "the rehearsal was killed by SIGKILL, "
                                      "most likely by the kernel's out-of-memory killer (this machine's host "
                                      "memory)"} if killed else None,
                          "error": None if killed else f"the rehearsal exited with code {proc.returncode}"}
            for text in proc.stderr.splitlines():  # angelgpt's own warnings; the rest only on failure
                if text.startswith("angelgpt: ") or (report.get("error") and not report.get("ran_out")):
                    print(text, file=sys.stderr)
            if report.get("coordinates") not in (None, where):
                print(f"angelgpt: warning: rank {rank} played {report['coordinates']}, expected {where}",
                      file=sys.stderr)
            report.update(stage=kind, coordinates=where, node_rank=rank // nproc_per_node, gpu_cap_bytes=gpu_cap,
                          host_budget_bytes=int(host_max * GIB), host_share_bytes=int(share * GIB),
                          host_limit_bytes=limit, host_limit=why, host_watched_peak_rss_bytes=proc.peak_rss_bytes,
                          cpu_threads=int(env["OMP_NUM_THREADS"]), exit_code=proc.returncode,
                          predicted=_predicted(
                              plans[where["pp_rank"]],
                              plan_for(resolved, here, nproc_per_node, nnodes, pp_rank=where["pp_rank"]) if here
                              else None, where["pp_rank"], hw.gpu_tflops, here.gpu_tflops if here else None))
            results.append(report)
            print(render_rank(report), flush=True)
            if not report.get("fits"):
                failed.append(report)
            if proc.over_bytes is not None:  # the rest would be held to the same budget: stop here
                break

    network = plan_for(resolved, hw, nproc_per_node, nnodes).step_s.get("network", 0.0)
    communication = {"network_s": network, "predicted": True,
                     "what": "the planner's data-parallel collective time per step left exposed beyond compute, "
                             "for the full job; tensor- and pipeline-parallel communication are not modelled, "
                             "and a rehearsal moves no data"}
    print(f"communication (predicted by the planner for the full job, not measured): {network:.4f} s per step "
          f"of data-parallel collectives exposed beyond compute; TP and PP communication not modelled", flush=True)
    summary = {"command": launch.format_command(["angelgpt", *sys.argv[1:]]), "commit": git_commit(),
               "rehearsed_on": _this_machine(on_gpu),
               "rehearsal": {"nnodes": nnodes, "nproc_per_node": nproc_per_node, "world_size": world,
                             "tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp,
                             "data_parallel_size": dp, "steps": steps, "device": "cuda" if on_gpu else "cpu",
                             "collectives": "fake (no data moved; losses meaningless)"},
               "target": asdict(hw), "resolved": line, "fits": not failed, "ranks": results,
               "predicted_communication": communication}
    if report_path:
        os.makedirs(os.path.dirname(os.path.abspath(report_path)), exist_ok=True)
        with open(report_path, "w") as fh:
            json.dump(summary, fh, indent=1, default=str)
        print(f"rehearsal report written to {report_path}", flush=True)
    ran_out = [r for r in failed if r.get("ran_out")]
    errors = [r for r in failed if not r.get("ran_out")]
    if errors:
        worst = errors[0]
        print(f"angelgpt: error: rehearsal of rank {worst['rank']} failed: {worst.get('error')}", file=sys.stderr,
              flush=True)
        raise SystemExit(2 if worst.get("exit_code") == 2 else 1)
    watched = [r for r in ran_out if r["ran_out"].get("by")]
    if watched:
        first = watched[0]
        print(f"angelgpt: error: rehearsal: rank {first['rank']} ({first['stage']} stage) "
              f"{first['ran_out']['message']}; stopped by the launcher", file=sys.stderr, flush=True)
        raise SystemExit(2)
    if ran_out:
        first = ran_out[0]
        who = ", ".join(f"rank {r['rank']} ({r['stage']} stage)" for r in ran_out)
        print(f"angelgpt: error: rehearsal: {who} ran out of {first['ran_out']['resource']}: "
              f"{first['ran_out']['message']}", file=sys.stderr, flush=True)
        raise SystemExit(2)
    print("rehearsal: every rehearsed rank fits", flush=True)
