"""The `angelgpt` command (Typer). Parses, resolves config, prints, launches torchrun.

    angelgpt presets list
    angelgpt presets show 55 --json
    angelgpt train --size tiny --device cpu
    angelgpt train --size 1.3b train.global_batch_size=512 --dry-run
    angelgpt train --size 55 --nproc-per-node 8 --dry-run --machine a100-40gx8

Nothing here imports torch.distributed at import time, so `--help` is instant. Bad input gets one
line on stderr and exit code 2.
"""

from __future__ import annotations

import json
import warnings
from typing import List, Optional

import typer

from angelgpt.cli import launch
from angelgpt.cli.launch import fail
from angelgpt.cli.tools import data_app, import_command, presets_app, tokenizer_app
from angelgpt.config import ConfigError, parse
from angelgpt.train import checkpoint_check  # (no torch: a --load is checked before torch is imported)

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  rich_markup_mode=None, help="GPT pretraining on Megatron-core with ZeRO-Cache.")
app.add_typer(presets_app, name="presets")
app.add_typer(tokenizer_app, name="tokenizer")
app.add_typer(data_app, name="data")
app.command("import")(import_command)


# the options of the job that `train`, `rehearse` and `plan` share
OVERRIDES = typer.Argument(None, help="KEY=VALUE config overrides (section.field)")
SIZE = typer.Option(None, "--size", help="preset name (see `angelgpt presets list`)")
CONFIG = typer.Option(None, "--config", help="YAML file layered over the preset")
NNODES = typer.Option(1, "--nnodes", min=1)
# the options `train` and `rehearse` share (a rehearsal describes the job's target with them)
NPROC = typer.Option(None, "--nproc-per-node", help="workers per node (of the job a rehearsal plays)")
DEVICE = typer.Option(None, "--device", help="cpu or cuda (this machine's, for a rehearsal)")


@app.command()
def plan(
    overrides: Optional[List[str]] = OVERRIDES,
    size: Optional[str] = typer.Option(None, "--size", help="preset name"),
    config: Optional[str] = CONFIG,
    machine: str = typer.Option("h200", "--machine", help="known machine whose figures are the defaults"),
    gpus_per_node: Optional[int] = typer.Option(None, "--gpus-per-node", min=1),
    nodes: int = typer.Option(1, "--nodes", min=1),
    gpu_mem: Optional[float] = typer.Option(None, "--gpu-mem", help="GiB per GPU"),
    host_mem: Optional[float] = typer.Option(None, "--host-mem", help="GiB of host memory per node"),
    nvme: Optional[float] = typer.Option(None, "--nvme", help="GiB of NVMe per node"),
    pcie_gbs: Optional[float] = typer.Option(None, "--pcie-gbs", help="GB/s per GPU each way"),
    nvme_gbs: Optional[float] = typer.Option(None, "--nvme-gbs",
                                            help="NVMe GB/s per node, read and write at once"),
    net_gbps: Optional[float] = typer.Option(None, "--net-gbps", help="collective GB/s per GPU"),
    gpu_tflops: Optional[float] = typer.Option(None, "--gpu-tflops", help="achieved dense TFLOP/s per GPU"),
    as_json: bool = typer.Option(False, "--json", help="print JSON"),
) -> None:
    """Before launch: does the model fit, where does each state go, how fast, what bounds it
    (ZeRO-Cache beside Megatron's distributed optimizer, its CPU offload and ZeRO-3 offload)."""
    from angelgpt.model.flops import num_params
    from angelgpt.planner import MACHINES, machine_from, plan as make_plan
    from angelgpt.planner.report import render, to_json

    if machine not in MACHINES:
        fail(f"--machine must be one of {', '.join(MACHINES)}, got '{machine}'")
    for name, value in (("--gpu-mem", gpu_mem), ("--host-mem", host_mem), ("--pcie-gbs", pcie_gbs),
                        ("--nvme-gbs", nvme_gbs), ("--net-gbps", net_gbps), ("--gpu-tflops", gpu_tflops)):
        if value is not None and not value > 0:
            fail(f"{name} must be > 0, got {value}")
    if nvme is not None and nvme < 0:
        fail(f"--nvme must be >= 0, got {nvme}")
    cfg = parse(size, config, list(overrides or []))
    cfg.check_device(on_gpu=True)  # plans are for GPUs: what training on one refuses, this refuses too
    hw = machine_from(machine, gpu_mem_gib=gpu_mem, host_mem_gib=host_mem, nvme_gib=nvme, pcie_gbs=pcie_gbs,
                      nvme_gbs=nvme_gbs, net_gbps=net_gbps, gpu_tflops=gpu_tflops, gpus_per_node=gpus_per_node)
    gpus = hw.gpus_per_node
    plans = make_plan(cfg, hw, gpus, nodes)
    if as_json:
        print(json.dumps(to_json(cfg, hw, gpus, nodes, plans, num_params(cfg)), indent=2))
    else:
        print(render(cfg, hw, gpus, nodes, plans, num_params(cfg)))


@app.command(context_settings={"allow_extra_args": False})
def train(
    overrides: Optional[List[str]] = OVERRIDES,
    size: Optional[str] = SIZE,
    config: Optional[str] = CONFIG,
    nproc_per_node: Optional[int] = NPROC,
    nnodes: Optional[int] = typer.Option(None, "--nnodes", min=1, help="default: SLURM_NNODES in a Slurm job, else 1"),
    node_rank: Optional[int] = typer.Option(None, "--node-rank", min=0, help="default: SLURM_NODEID, else 0"),
    master_addr: Optional[str] = typer.Option(None, "--master-addr", help="default: SLURM_JOB_NODELIST's first"),
    master_port: Optional[int] = typer.Option(None, "--master-port", help="default: MASTER_PORT or from SLURM_JOB_ID"),
    rdzv_endpoint: Optional[str] = typer.Option(None, "--rdzv-endpoint", help="HOST:PORT (c10d rendezvous)"),
    max_restarts: int = typer.Option(0, "--max-restarts", min=0, help="torchrun restarts on worker failure"),
    device: Optional[str] = DEVICE,
    dry_run: bool = typer.Option(False, "--dry-run", help="print config and torchrun command, write "
                                 "the run config that command trains on, launch nothing"),
    metrics_file: Optional[str] = typer.Option(None, "--metrics-file", help="JSON-lines metrics output"),
    save: Optional[str] = typer.Option(None, "--save", help="checkpoint directory to save into"),
    load: Optional[str] = typer.Option(None, "--load", help="checkpoint directory to resume from"),
    force: bool = typer.Option(False, "--force", help="launch even when the planner says it will not fit"),
    machine: Optional[str] = typer.Option(None, "--machine", help="catalogue machine a dry run plans and resolves "
                                          "for (default: this machine)"),
) -> None:
    """Resolve the config, print it and the parameter count, check the plan, and launch torchrun workers."""
    from angelgpt.cli.prepare import prepare
    from angelgpt.cli.slurm import fill

    # in a multi-node Slurm job the flags not given come from srun's environment
    nnodes, node_rank, master_addr, master_port = fill(nnodes, node_rank, master_addr, master_port, rdzv_endpoint)
    extra = [*(overrides or []), *(f"{key}={value}" for key, value in (
        ("logging.metrics_file", metrics_file), ("checkpoint.save", save), ("checkpoint.load", load)) if value)]
    if machine is not None and not dry_run:
        fail(f"--machine applies to a dry run: add --dry-run (`angelgpt rehearse --machine {machine}` rehearses "
             f"the job for it)")
    job = prepare(size, config, extra, device, nproc_per_node, nnodes or 1, machine, launch_dry_run=dry_run)
    _launch(job, launch.Rendezvous(job.nproc_per_node, job.nnodes, node_rank or 0, master_addr, master_port,
                                   rdzv_endpoint, max_restarts), machine, dry_run, force)


def _launch(job, rdzv, machine: Optional[str], dry_run: bool, force: bool) -> None:
    """`train`'s job launched (or its dry run printed), under the --save lock, unless its checkpoint is done."""
    from angelgpt.cli import job as training
    from angelgpt.planner import machine_from
    from angelgpt.train.lifetime import take_save_lock

    cfg = job.cfg
    resume_at = launch.resume_point(cfg)  # a checkpoint to resume from that will not do is refused first
    # one run per --save DIR, taken before anything is printed: a second run's refusal is one line
    lock = None if dry_run else take_save_lock(cfg.checkpoint.save, rdzv.nnodes, rdzv.node_rank, rdzv.rdzv_endpoint)
    # a dry run for --machine plans for that catalogue machine's figures, not this machine's
    target = machine_from(machine, gpus_per_node=rdzv.nproc_per_node) if machine is not None else None
    try:
        if launch.nothing_to_train(cfg, resume_at):
            return
        training.launch(cfg, job.on_gpu, job.gpu_here, target, job.data_parallel_size, dry_run, force, rdzv)
    finally:
        if lock is not None:
            lock.release()


@app.command("rehearse", context_settings={"allow_extra_args": False})
def rehearse_command(
    overrides: Optional[List[str]] = OVERRIDES,
    size: Optional[str] = SIZE,
    config: Optional[str] = CONFIG,
    nproc_per_node: Optional[int] = NPROC,
    nnodes: int = NNODES,
    device: Optional[str] = DEVICE,
    machine: Optional[str] = typer.Option(None, "--machine", help="catalogue machine whose figures describe the "
                                          "target (default: this machine's GPU)"),
    gpu_mem: Optional[float] = typer.Option(None, "--gpu-mem", help="GiB per GPU of the target (default: this "
                                            "GPU's, or --machine's)"),
    host_mem: Optional[float] = typer.Option(None, "--host-mem", help="GiB of host memory per node of the target "
                                             "(default: this machine's available, or --machine's)"),
    rank: Optional[List[int]] = typer.Option(None, "--rank", help="rank to rehearse; repeatable (default: rank 0 "
                                             "of the first, a middle and the last stage)"),
    steps: int = typer.Option(3, "--steps", help="training steps per rehearsed rank"),
    report: Optional[str] = typer.Option(None, "--report", help="JSON report of the rehearsal"),
    dry_run: bool = typer.Option(False, "--dry-run", help="print the config and the rank's command, write the run "
                                 "config it reads, run nothing"),
) -> None:
    """Rehearse a job's ranks one at a time on this machine (fake collectives), each beside the planner's
    prediction; exit 2 if one runs out of the target's memory."""
    from angelgpt.cli.prepare import prepare
    from angelgpt.cli.rehearse import Options, rehearse

    job = prepare(size, config, list(overrides or []), device, nproc_per_node, nnodes, machine, rehearsal=True)
    rehearse(job, Options(rank, steps, machine, gpu_mem, host_mem, report, dry_run))


@app.command("export")
def export_command(
    load: str = typer.Option(..., "--load", help="checkpoint directory (--save of a run) or one iter_N directory"),
    output: str = typer.Option(..., "--output", help="transformers model directory to write"),
    iteration: Optional[int] = typer.Option(None, "--iteration", help="checkpoint iteration (default: latest)"),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="bf16 or fp32 (default: as stored)"),
    max_shard_size: str = typer.Option("5GB", "--max-shard-size", help="larger models are sharded, e.g. 2GB"),
    tokenizer: Optional[str] = typer.Option(None, "--tokenizer", help="tokenizer directory (default: the run's)"),
    trim_vocab: bool = typer.Option(False, "--trim-vocab", help="vocab_size = model.vocab_size, not the padded one"),
    overwrite: bool = typer.Option(False, "--overwrite", help="replace an existing --output"),
) -> None:
    """A checkpoint as a Hugging Face transformers GPT-2 or Llama directory (safetensors, config, tokenizer)."""
    checkpoint_check.find_checkpoint(load, iteration)
    from angelgpt.export import quiet
    from angelgpt.export.export import export

    with quiet():
        s = export(load, output, iteration, dtype, max_shard_size, tokenizer, trim_vocab, overwrite)
    shards = [f for f in s["files"] if f.endswith(".safetensors")]
    weights = shards[0] if len(shards) == 1 else f"{len(shards)} safetensors shards and their index"
    print(f"wrote {s['output']}: {s['architecture']}, {s['parameters']:,} parameters ({s['dtype']}) from iteration "
          f"{s['iteration']}, {weights}" + (", tokenizer" if s["tokenizer"] else ""))


@app.command("generate")
def generate_command(
    load: str = typer.Option(..., "--load", help="checkpoint directory or exported transformers directory"),
    prompt: str = typer.Option(..., "--prompt", help="text (token ids separated by spaces for mock-data runs)"),
    max_new_tokens: int = typer.Option(50, "--max-new-tokens"),
    temperature: float = typer.Option(1.0, "--temperature", help="0: greedy"),
    top_k: Optional[int] = typer.Option(None, "--top-k", help="sample among the k likeliest (default: all)"),
    seed: int = typer.Option(1234, "--seed"),
    device: str = typer.Option("cpu", "--device", help="cpu or cuda"),
    iteration: Optional[int] = typer.Option(None, "--iteration", help="checkpoint iteration (default: latest)"),
    as_json: bool = typer.Option(False, "--json", help='print {"prompt_ids", "new_ids", "text", "stop_reason"}'),
) -> None:
    """Continue a prompt with a checkpoint (angelgpt's GPT, one process) or an exported model."""
    if not checkpoint_check.is_hf_dir(load):
        checkpoint_check.find_checkpoint(load, iteration)
    from angelgpt.export import quiet
    from angelgpt.export.generate import generate, render

    with quiet():
        result = generate(load, prompt, max_new_tokens, temperature, top_k, seed, device, iteration)
    print(render(result, as_json))


@app.command("eval")
def eval_command(
    overrides: Optional[List[str]] = typer.Argument(None, help="KEY=VALUE over the run's config, e.g. data.paths=..."),
    load: str = typer.Option(..., "--load", help="checkpoint directory"),
    iteration: Optional[int] = typer.Option(None, "--iteration", help="checkpoint iteration (default: latest)"),
    iters: Optional[int] = typer.Option(None, "--iters", help="global batches (default: the run's train.eval_iters)"),
    device: str = typer.Option("cpu", "--device", help="cpu or cuda"),
    as_json: bool = typer.Option(False, "--json", help="print JSON"),
) -> None:
    """Validation loss and perplexity of a checkpoint, without training (one process, any layout)."""
    checkpoint_check.find_checkpoint(load, iteration)
    from angelgpt.export import quiet
    from angelgpt.export.evaluate import evaluate, render

    with quiet():
        result = evaluate(load, list(overrides or []), iters, iteration, device)
    print(render(result, as_json))


def main(argv: Optional[List[str]] = None) -> None:
    """Entry point: one-line errors, exit 2 on bad input, never a traceback for it."""
    warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex.*")
    command = typer.main.get_command(app)
    try:
        command.main(args=argv, prog_name="angelgpt", standalone_mode=False)
    except ConfigError as exc:
        fail(str(exc))
    except typer.Exit as exc:
        raise SystemExit(exc.exit_code)
    except typer.Abort:
        fail("aborted")
    except typer.TyperException as exc:
        ctx = getattr(exc, "ctx", None)
        if type(exc).__name__ == "NoArgsIsHelpError" and ctx is not None:
            print(ctx.get_help())
            raise SystemExit(0)
        message = exc.format_message() if hasattr(exc, "format_message") else str(exc)
        where = f"{ctx.command_path}: " if ctx is not None else ""
        fail(where + " ".join(message.split()))
    except KeyboardInterrupt:
        raise SystemExit(130)
