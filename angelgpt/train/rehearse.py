"""One rehearsed rank: `angelgpt rehearse` starts this, one process per rank it rehearses.

The process plays rank R of the real job's world (ANGELGPT_REHEARSE: rank, world size, GPU cap, report
path) under torch's fake process group (angelgpt.parallel): Megatron's parallel state for the whole
world, the rank's real model shard and, with ZeRO-Cache, its real placement over real tiers, then a few
real training steps on the config's data. Collectives return at once and move no data, so losses are
meaningless (a receive yields standard normal values) and the loop neither skips nor aborts on non-finite values.

On GPU the allocator is capped at the target GPU's memory (exceeding it is a real CUDA out-of-memory
error); ZeRO-Cache's host budget is the target node's host memory per GPU (zero_cache.host_max_gib, set
by the launcher). It writes its RankReport (angelgpt.train.rank_report: what it measured, what stopped
it) as JSON to the report path and exits 0 when the rank ran, 2 when it ran out of memory (or its input
was refused), 1 on any other failure.

It builds from the run config the launcher resolved once for the target (every 'auto' a value):

    ANGELGPT_REHEARSE='{"rank": 4, "world_size": 8, "report": "r4.json"}' \\
        python -m angelgpt.train.rehearse --run-config RUN_DIR/run-config.yaml
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import sys
import traceback
import warnings
from typing import List, Optional

from angelgpt.train.rank_report import Measured, RankReport, RanOut, Step, ZeroCacheMeasured

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


def _ran_out(exc: BaseException, on_gpu: bool) -> Optional[RanOut]:
    """What ran short when exc says memory did, else None."""
    import torch

    from angelgpt.zero_cache.tiers import CapacityError

    first = next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
    if isinstance(exc, CapacityError):
        names = {"device": "GPU memory" if on_gpu else "device-tier memory (the CPU standing in for the GPU)",
                 "host": "host memory", "nvme": "NVMe space", "memlock": "pinnable host memory (memlock limit)"}
        return RanOut(", ".join(names.get(t, t) for t in exc.short), first)
    if isinstance(exc, torch.OutOfMemoryError):
        return RanOut("GPU memory", first[:300])
    if isinstance(exc, MemoryError) or (isinstance(exc, RuntimeError) and "can't allocate memory" in first):
        return RanOut("host memory", first[:300])
    return None


def _measure(trainer, on_gpu: bool) -> Measured:
    import torch

    gpu = {"gpu_peak_allocated_bytes": 0, "gpu_peak_reserved_bytes": 0}
    if on_gpu and torch.cuda.is_initialized():
        gpu = {"gpu_peak_allocated_bytes": int(torch.cuda.max_memory_allocated()),
               "gpu_peak_reserved_bytes": int(torch.cuda.max_memory_reserved()),
               "gpu_alloc_retries": int(torch.cuda.memory_stats().get("num_alloc_retries", 0))}
    if trainer is None:
        return Measured(_peak_rss_bytes(), **gpu)
    from angelgpt.optimizer.zero_cache import ZeroCacheOptimizer

    opt, zc = trainer.optimizer, None
    if isinstance(opt, ZeroCacheOptimizer):
        zc = ZeroCacheMeasured(opt.memory(), opt.pinned_bytes(), dict(opt.layout.planned_bytes), opt.placement())
    return Measured(_peak_rss_bytes(), **gpu, steps=[Step.of_record(r) for r in trainer.records], zero_cache=zc)


def main(argv=None) -> int:
    from angelgpt.train.lifetime import watch_launcher

    watch_launcher()
    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    from angelgpt import parallel
    from angelgpt.parallel.log import setup_logging

    setup_logging(rank_prefix=True)  # this rank's lines, as every rehearsed rank's, shown as '[rank R] ...'
    settings = json.loads(os.environ[REHEARSE_ENV])
    report = RankReport(settings["rank"])
    rehearsal = parallel.Rehearsal(settings["rank"], settings["world_size"], settings.get("gpu_cap_bytes"))
    with contextlib.ExitStack() as started:  # the rehearsal, left only when the rank ran
        trainer, rc = _play(rehearsal, sys.argv[1:] if argv is None else argv, report, started)
        report.measured = _measure(trainer, report.device == "cuda")
        with open(settings["report"], "w") as fh:
            json.dump(report.to_json(), fh, indent=1, default=str)
        sys.stdout.flush()
        sys.stderr.flush()
        if rc:  # a half-built optimizer may hold threads: end here, as a killed run would
            os._exit(rc)
    return 0


def _play(rehearsal, argv, report: RankReport, started: contextlib.ExitStack):
    """(trainer or None, exit code): the rank built within `rehearsal`, started in `started`, and trained;
    where it ran, what it resolved and where Megatron put it, and what stopped it, recorded in `report`."""
    from megatron.core import parallel_state

    from angelgpt.config import ConfigError
    from angelgpt.train.worker import make_trainer, read_run_config

    trainer = None
    try:
        cfg = read_run_config(argv)
        report.device = cfg.train.device
        started.enter_context(rehearsal.started(cfg.parallel.tensor_model_parallel_size,
                                                cfg.parallel.pipeline_model_parallel_size, report.device == "cuda"))
        trainer = make_trainer(cfg, rehearsal)
        report.coordinates = {"tp_rank": parallel_state.get_tensor_model_parallel_rank(),
                              "pp_rank": parallel_state.get_pipeline_model_parallel_rank(),
                              "dp_rank": parallel_state.get_data_parallel_rank()}
        report.config = {"resolved": {"model.recompute": trainer.cfg.model.recompute,
                                      "model.recompute_num_layers": trainer.cfg.model.recompute_num_layers,
                                      **({f"zero_cache.{k}": getattr(trainer.cfg.zero_cache, k) for k in (
                                          "prefetch_cache_sub_group_rate", "offload_params",
                                          "accumulate_in_store", "device_update_fraction", "cpu_adam",
                                          "host_max_gib")} if trainer.cfg.optim.spec.uses_zero_cache_settings
                                         else {})}}
        trainer.train()
        report.fits = True
        return trainer, 0
    except Exception as exc:  # noqa: BLE001 - every failure is reported, then the process ends
        report.ran_out = _ran_out(exc, report.device == "cuda")
        if report.ran_out is not None:
            return trainer, 2
        if isinstance(exc, ConfigError):
            report.error = str(exc)
            return trainer, 2
        report.error = f"{type(exc).__name__}: {exc}"
        traceback.print_exc()
        return trainer, 1


if __name__ == "__main__":
    sys.exit(main())
