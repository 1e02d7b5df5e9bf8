"""The training job `angelgpt train` starts: its config resolved for the machine that runs it (or a
dry run's --machine), the config, command and plan printed, a plan that does not fit refused, the
resolved run config written and torchrun run on it (its workers' only input).
"""

from __future__ import annotations

import shutil
import sys

import yaml

from angelgpt.cli.launch import fail
from angelgpt.config import to_dict


def resolve_for(cfg, on_gpu: bool, nproc_per_node: int, nnodes: int, target=None):
    """Every 'auto' of the config made concrete for this machine (its GPU, host memory and disk as read
    here, before any worker starts). With `target` (a catalogue Machine, --machine of a dry run): for
    that machine's figures instead."""
    from angelgpt.planner import read_this_machine, resolve_config, resolved_line

    machine = target or read_this_machine(cfg.zero_cache, nproc_per_node, before_workers=True)
    resolved, plan = resolve_config(cfg, machine, nproc_per_node, nnodes, on_gpu)
    return machine, resolved, plan, resolved_line(cfg, resolved)


def check_plan(p, force: bool) -> None:
    """On GPU: the resolved config's plan for this machine; one that does not fit is refused before
    anything is launched, unless --force."""
    from angelgpt.planner import GIB

    print(f"plan: {p.system} needs {p.gpu_total / GIB:.1f} GiB per GPU and {p.host_total / GIB:.1f} GiB of host "
          f"memory per node; predicted {p.step_time_s:.2f} s per step, bound by {p.bottleneck}"
          + (f"; rate {p.rate:.2f}" if p.rate is not None else "")
          + (f"; recompute {p.recompute_label()}" if p.recompute != "none" else ""), flush=True)
    if not p.fits and not force:
        short = ", ".join(f"{k} by {-v / GIB:.1f} GiB" for k, v in p.margin.items() if v < 0)
        fail(f"the planner says this configuration does not fit ({p.system}: short of {short}); see "
             f"`angelgpt plan`, or pass --force to launch anyway")


def launch(cfg, on_gpu: bool, gpu_here: bool, target, dp: int, dry_run: bool, force: bool, rdzv) -> None:
    """Resolves every 'auto' for this machine (for `target`, a dry run's --machine, where given), prints
    the config, the command and the plan, refuses what does not fit, writes the resolved run config and
    runs torchrun on it. A dry run writes the run config its printed command reads, and runs nothing. A
    dry run of a GPU job on a machine without a GPU and no target resolves, plans and writes nothing, and
    says so in place of the command."""
    from angelgpt.cli import launch
    from angelgpt.model.flops import format_params, num_params

    skipped = on_gpu and not gpu_here and target is None  # only a dry run gets here so (see train)
    if skipped:
        machine, planned, resolved = None, None, ""
    else:
        machine, cfg, planned, resolved = resolve_for(cfg, on_gpu, rdzv.nproc_per_node, rdzv.nnodes, target)
    # kept in checkpoint.save by the launcher that locks it (one node's; none with --rdzv-endpoint)
    keep = rdzv.nnodes == 1 or (rdzv.node_rank == 0 and not rdzv.rdzv_endpoint)
    folder, own = (None, False) if skipped else launch.run_config_folder(cfg, keep, dry_run)
    try:
        path = folder / launch.RUN_CONFIG if folder is not None else None
        cmd = launch.worker_command(rdzv, path) if path is not None else None
        print(yaml.safe_dump(to_dict(cfg), sort_keys=False).rstrip())
        params = num_params(cfg)
        print(f"params: {params:,} ({format_params(params)}) | world size {rdzv.nproc_per_node * rdzv.nnodes} = "
              f"TP {cfg.parallel.tensor_model_parallel_size} x PP {cfg.parallel.pipeline_model_parallel_size} x "
              f"DP {dp}")
        if cmd is not None:
            print(f"torchrun command: {launch.format_command(cmd)}", flush=True)
        else:
            print("torchrun command: none: its run config is resolved for the machine that runs the job "
                  "(`angelgpt train` there; --machine NAME here resolves it for a catalogue machine)", flush=True)
        if resolved:
            print(resolved, flush=True)
        if skipped:
            print("plan: skipped, no GPU is visible here; --machine NAME plans for a catalogue machine", flush=True)
        if target is not None:
            print(f"target machine: {target.name} ({target.gpus_per_node} x {target.gpu} {target.gpu_mem_gib:g} GiB, "
                  f"{target.host_mem_gib:g} GiB host memory per node; the catalogue's figures, not this machine's)",
                  flush=True)
        if planned is not None:
            check_plan(planned, force)
        if path is not None:
            launch.write_run_config(path, cfg, machine, cmd)
        if dry_run:
            if path is not None:
                print(f"run config: {path} (written by this dry run: the torchrun command above trains on it)",
                      flush=True)
            return
        env = launch.worker_env(on_gpu, rdzv.nproc_per_node, cfg.optim.optimizer, rdzv.max_restarts)
        warning = launch.queue_warning(env, on_gpu, cfg.optim.optimizer)
        if warning:
            print(warning, file=sys.stderr, flush=True)
        rc, why = launch.run(cmd, env, cfg.checkpoint.stop_grace_s, rdzv.max_restarts)
    except BaseException:
        if dry_run and folder is not None:  # a refused dry run leaves no run config behind
            shutil.rmtree(folder, ignore_errors=True)
        raise
    finally:
        if own:
            shutil.rmtree(folder, ignore_errors=True)
    if rc == 2:
        raise SystemExit(2)
    if rc != 0:
        print(f"angelgpt: error: training workers exited with code {rc}" + (f": {why}" if why else ""),
              file=sys.stderr, flush=True)
        raise SystemExit(1)
