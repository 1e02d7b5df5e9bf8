"""What `angelgpt train` and `angelgpt rehearse` prepare alike before either starts anything: the job's
config parsed and checked for the device its ranks run on, its ranks per node and nodes (`prepare`,
giving a `Job`). Bad input is a ConfigError or `fail`: one line, exit 2. No torch import at module
level (torch is imported only to look for a GPU).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

from angelgpt.cli.launch import fail
from angelgpt.config import Config, ConfigError, parse


@dataclass(frozen=True)
class Job:
    """A job as `train` launches it and `rehearse` plays it. `overrides`: the KEY=VALUE the config is
    parsed with over its preset (`size`) and YAML (`config`), the device's among them; `on_gpu`: its
    ranks run on GPUs; `gpu_here`: this machine has a GPU it takes."""

    cfg: Config
    size: Optional[str]
    config: Optional[str]
    overrides: Tuple[str, ...]
    on_gpu: bool
    gpu_here: bool
    nproc_per_node: int
    nnodes: int

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes

    @property
    def data_parallel_size(self) -> int:
        return self.cfg.data_parallel_size(self.world_size)

    def parse(self, more: List[str]) -> Config:
        """The job's config with `more` overrides after its own."""
        return parse(self.size, self.config, [*self.overrides, *more])


def _detect_gpu(device: Optional[str]) -> bool:
    if device == "cpu":
        return False
    import torch

    available = torch.cuda.is_available()
    if device == "cuda" and not available:
        fail("--device cuda but no CUDA GPU is visible")
    return available


def prepare(size: Optional[str], config: Optional[str], overrides: List[str], device: Optional[str],
            nproc_per_node: Optional[int], nnodes: int, machine: Optional[str], launch_dry_run: bool = False,
            rehearsal: bool = False) -> Job:
    """The job of the options given, its config checked for the device its ranks run on and its data
    checked (files, tokenizer, splits). `launch_dry_run` (train's --dry-run): the job runs on the machine
    its command is printed for, which need not be this one: on GPUs when it names them (--nproc-per-node,
    --machine or device cuda), as many per node as --machine has. `rehearsal`: a GPU job is refused
    without a GPU here unless its device is chosen (refuse_without_gpu)."""
    from angelgpt.planner import MACHINES

    if device not in (None, "cpu", "cuda"):
        fail(f"--device must be 'cpu' or 'cuda', got '{device}'")
    extra = list(overrides) + ([f"train.device={device}"] if device else [])
    cfg = parse(size, config, extra)
    wanted = device or (None if cfg.train.device == "auto" else cfg.train.device)
    if machine is not None and machine not in MACHINES:
        fail(f"--machine must be one of {', '.join(MACHINES)}, got '{machine}'")
    gpu_job = launch_dry_run and wanted != "cpu" and (machine is not None or nproc_per_node is not None
                                                      or wanted == "cuda")
    if launch_dry_run and machine is not None and wanted == "cpu":
        fail(f"--machine {machine} is a GPU machine: a dry run for it cannot have device cpu")
    gpu_here = _detect_gpu(None if gpu_job else wanted)
    on_gpu = gpu_job or gpu_here
    if nproc_per_node is None:
        if machine is not None and launch_dry_run:
            nproc_per_node = MACHINES[machine].gpus_per_node
        elif gpu_here:
            import torch

            nproc_per_node = torch.cuda.device_count()
        else:
            nproc_per_node = cfg.model_parallel_size
    if nproc_per_node < 1:
        fail(f"--nproc-per-node must be >= 1, got {nproc_per_node}")
    cfg.data_parallel_size(nproc_per_node * nnodes)
    if rehearsal and not on_gpu and wanted is None:  # its CPU form is the user's choice, --device cpu
        refuse_without_gpu(cfg, machine)
    _check(cfg, on_gpu, launch_dry_run and not on_gpu and wanted is None)
    if not on_gpu and "train.device=cpu" not in extra:
        extra.append("train.device=cpu")
    return Job(cfg, size, config, tuple(extra), on_gpu, gpu_here, nproc_per_node, nnodes)


def refuse_without_gpu(cfg, machine: Optional[str]) -> None:
    """A GPU job (its target a catalogue GPU machine, or a config the CPU cannot run) rehearsed where no GPU
    is visible, its device not chosen: refused in one line saying what works. Rehearsing on the CPU is
    chosen with --device cpu, for a model the CPU can hold."""
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


def _check(cfg: Config, on_gpu: bool, cpu_for_want_of_gpus: bool) -> None:
    """The config against the device and its data (files, the tokenizer's vocabulary, the splits), before
    anything is launched. `cpu_for_want_of_gpus`: a dry run's job on the CPU only because it named no GPUs."""
    try:
        cfg.check_device(on_gpu)
    except ConfigError as exc:
        if cpu_for_want_of_gpus:
            raise ConfigError(f"{exc} (no GPU is visible here: a dry run of a GPU job names its GPUs, "
                              f"--nproc-per-node N or --machine NAME)") from None
        raise
    cfg.data.check_files()
    if not cfg.data.is_mock:
        from angelgpt.data.dataset import check_splits
        from angelgpt.data.tokenizer import check_vocabulary, load_tokenizer

        check_vocabulary(load_tokenizer(cfg.data.tokenizer), cfg)
        check_splits(cfg, validating=bool(cfg.train.eval_interval and cfg.train.eval_iters))
