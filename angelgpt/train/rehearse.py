"""One rehearsed rank: `angelgpt rehearse` starts this, one process per rank it rehearses.

The process plays rank R of the real job's world (ANGELGPT_REHEARSE: rank, world size, GPU cap, report
path) under torch's fake process group (angelgpt.parallel): Megatron's parallel state for the whole
world, the rank's real model shard and, with ZeRO-Cache, its real placement over real tiers, then a few
real training steps on the config's data. Collectives return at once and move no data, so losses are
meaningless (a receive yields standard normal values) and the loop neither skips nor aborts on non-finite values.

On GPU the allocator is capped at the target GPU's memory (exceeding it is a real CUDA out-of-memory
error); ZeRO-Cache's host budget is the target node's host memory per GPU (zero_cache.host_max_gib, set
by the launcher). It writes what it measured as JSON to the report path and exits 0 when the rank ran,
2 when it ran out of memory (or its input was refused), 1 on any other failure.

It builds from the run config the launcher resolved once for the target (every 'auto' a value):

    ANGELGPT_REHEARSE='{"rank": 4, "world_size": 8, "report": "r4.json"}' \\
        python -m angelgpt.train.rehearse --run-config RUN_DIR/run-config.yaml
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import resource
import sys
import traceback
import warnings
from typing import List

REHEARSE_ENV = "ANGELGPT_REHEARSE"


def played_overrides(steps: int) -> List[str]:
    """What a rehearsed rank changes in the job's config: `steps` steps that read and write nothing but
    its report, every one logged and its communication timed."""
    return [f"train.train_iters={steps}", "train.eval_interval=null", "train.exit_interval=null",
            "checkpoint.save=null", "checkpoint.load=null", "logging.metrics_file=null",
            "logging.tensorboard_dir=null", "logging.wandb_project=null", "logging.profile_steps=null",
            "logging.log_interval=1", "zero_cache.is_communication_time_profiling=true"]


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def _ran_out(exc: BaseException, on_gpu: bool):
    """(resource, message) when exc says memory ran short, else None."""
    import torch

    from angelgpt.zero_cache.tiers import CapacityError

    first = next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
    if isinstance(exc, CapacityError):
        names = {"device": "GPU memory" if on_gpu else "device-tier memory (the CPU standing in for the GPU)",
                 "host": "host memory", "nvme": "NVMe space", "memlock": "pinnable host memory (memlock limit)"}
        return ", ".join(names.get(t, t) for t in exc.short), first
    if isinstance(exc, torch.OutOfMemoryError):
        return "GPU memory", first[:300]
    if isinstance(exc, MemoryError) or (isinstance(exc, RuntimeError) and "can't allocate memory" in first):
        return "host memory", first[:300]
    return None


def _measure(trainer, on_gpu: bool) -> dict:
    import torch

    out = {"host_peak_rss_bytes": _peak_rss_bytes(), "gpu_peak_allocated_bytes": 0, "gpu_peak_reserved_bytes": 0}
    if on_gpu and torch.cuda.is_initialized():
        out["gpu_peak_allocated_bytes"] = int(torch.cuda.max_memory_allocated())
        out["gpu_peak_reserved_bytes"] = int(torch.cuda.max_memory_reserved())
        # nonzero: the allocator reached the cap, gave its cache back and retried, so the peak reserved is
        # the cap's, not the rank's need
        out["gpu_alloc_retries"] = int(torch.cuda.memory_stats().get("num_alloc_retries", 0))
    if trainer is None:
        return out
    out["steps"] = [{k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in r.items()}
                    for r in trainer.records]  # JSON has no NaN: a meaningless loss is null
    from angelgpt.optimizer.zero_cache import ZeroCacheOptimizer

    opt = trainer.optimizer
    if isinstance(opt, ZeroCacheOptimizer):
        out["zero_cache"] = {"tier_bytes": opt.memory(), "host_pinned_bytes": opt.pinned_bytes(),
                             "planned_bytes": dict(opt.layout.planned_bytes), "summary": opt.placement()}
    return out


def main(argv=None) -> int:
    from angelgpt.train.lifetime import watch_launcher

    watch_launcher()
    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    from angelgpt import parallel
    from angelgpt.parallel.log import setup_logging

    setup_logging(rank_prefix=True)  # this rank's lines, as every rehearsed rank's, shown as '[rank R] ...'
    settings = json.loads(os.environ[REHEARSE_ENV])
    report = {"rank": settings["rank"], "fits": False, "ran_out": None, "error": None}
    rehearsal = parallel.Rehearsal(settings["rank"], settings["world_size"], settings.get("gpu_cap_bytes"))
    with contextlib.ExitStack() as started:  # the rehearsal, left only when the rank ran
        trainer, on_gpu, rc = _play(rehearsal, sys.argv[1:] if argv is None else argv, report, started)
        report["device"] = "cuda" if on_gpu else "cpu"
        report["measured"] = _measure(trainer, on_gpu)
        with open(settings["report"], "w") as fh:
            json.dump(report, fh, indent=1, default=str)
        sys.stdout.flush()
        sys.stderr.flush()
        if rc:  # a half-built optimizer may hold threads: end here, as a killed run would
            os._exit(rc)
    return 0


def _play(rehearsal, argv, report: dict, started: contextlib.ExitStack):
    """(trainer or None, on GPU, exit code): the rank built within `rehearsal`, started in `started`, and
    trained; what it resolved and where Megatron put it, and what stopped it, recorded in `report`."""
    from megatron.core import parallel_state

    from angelgpt.config import ConfigError
    from angelgpt.train.worker import make_trainer, read_run_config

    trainer, on_gpu = None, False
    try:
        cfg = read_run_config(argv)
        on_gpu = cfg.train.device == "cuda"
        started.enter_context(rehearsal.started(cfg.parallel.tensor_model_parallel_size,
                                                cfg.parallel.pipeline_model_parallel_size, on_gpu))
        trainer = make_trainer(cfg, rehearsal)
        report["coordinates"] = {"tp_rank": parallel_state.get_tensor_model_parallel_rank(),
                                 "pp_rank": parallel_state.get_pipeline_model_parallel_rank(),
                                 "dp_rank": parallel_state.get_data_parallel_rank()}
        report["config"] = {"resolved": {"model.recompute": trainer.cfg.model.recompute,
                                         "model.recompute_num_layers": trainer.cfg.model.recompute_num_layers,
                                         **({f"zero_cache.{k}": getattr(trainer.cfg.zero_cache, k) for k in (
                                             "prefetch_cache_sub_group_rate", "offload_params",
                                             "accumulate_in_store", "device_update_fraction", "cpu_adam",
                                             "host_max_gib")} if trainer.cfg.optim.spec.uses_zero_cache_settings
                                            else {})}}
        trainer.train()
        report["fits"] = True
        return trainer, on_gpu, 0
    except Exception as exc:  # noqa: BLE001 - every failure is reported, then the process ends
        out = _ran_out(exc, on_gpu)
        if out is not None:
            report["ran_out"] = {"resource": out[0], "message": out[1]}
            return trainer, on_gpu, 2
        if isinstance(exc, ConfigError):
            report["error"] = str(exc)
            return trainer, on_gpu, 2
        report["error"] = f"{type(exc).__name__}: {exc}"
        traceback.print_exc()
        return trainer, on_gpu, 1


if __name__ == "__main__":
    sys.exit(main())
