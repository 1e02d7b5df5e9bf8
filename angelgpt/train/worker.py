"""torchrun worker: one process per GPU (or CPU rank), built from the resolved run config that
`angelgpt train` writes (every 'auto' a value) and names on the worker's command line, its only input.
`angelgpt train` launches it; `angelgpt train --dry-run` writes the run config and prints the command:

    torchrun --standalone --nproc-per-node 2 -m angelgpt.train.worker --run-config RUN_DIR/run-config.yaml
"""

from __future__ import annotations

import logging
import os
import sys
import warnings

from angelgpt.config import ResolvedConfig
from angelgpt.parallel.log import get_logger, setup_logging

log = get_logger(__name__)

RUN_CONFIG_FLAG = "--run-config"


def read_run_config(argv) -> ResolvedConfig:
    """The worker's command line, `--run-config PATH`: the resolved config at PATH. Anything else on it,
    or a config still holding an 'auto', is refused (ConfigError, one line)."""
    from angelgpt.config import ConfigError, load_run_config

    path = None
    if len(argv) == 2 and argv[0] == RUN_CONFIG_FLAG:
        path = argv[1]
    elif len(argv) == 1 and argv[0].startswith(RUN_CONFIG_FLAG + "="):
        path = argv[0].partition("=")[2]
    if not path:
        raise ConfigError(f"the worker takes {RUN_CONFIG_FLAG} PATH (the resolved run config `angelgpt train` "
                          f"writes; `angelgpt train --dry-run` writes one and prints its command), got "
                          f"{' '.join(argv) or 'nothing'}")
    return load_run_config(path)


def build(cfg: ResolvedConfig, on_gpu: bool, beside_store_bytes: int = 0, rehearsal: bool = False):
    """Model, optimizer and scheduler for this rank, from a resolved config; `rehearsal`: the rank is
    played alone under fake collectives (angelgpt.parallel.rehearsal)."""
    from angelgpt.model.gpt import build_gpt
    from angelgpt.optimizer.schedule import build_scheduler

    spec = cfg.optim.spec
    # an optimizer that places layers itself (ZeRO-Cache) on GPU: layers built on the meta device, made
    # real one at a time while its store fills (a rank's full weights need not fit its GPU, only the
    # resident ones and one offloaded layer) (not with transformer-engine's spec, whose modules angelgpt
    # does not rebuild)
    defer = on_gpu and spec.defers_layer_init and cfg.model.transformer_impl != "transformer_engine"
    model = build_gpt(cfg, on_gpu, defer_layers=defer)
    if on_gpu:
        from megatron.core.transformer.module import Float16Module

        model = Float16Module(model.config, model)  # bf16 weights and inputs, fp32 loss
    model, optimizer = spec.builder()(model, cfg, on_gpu, deferred=defer, beside_store_bytes=beside_store_bytes,
                                      rehearsal=rehearsal)
    return model, optimizer, build_scheduler(optimizer, cfg)


def follow_rank0(cfg: ResolvedConfig) -> ResolvedConfig:
    """Rank 0's config on every rank (what the others pass is replaced)."""
    import torch.distributed as dist

    choice = [cfg]
    dist.broadcast_object_list(choice, src=0)
    return choice[0]


def run(cfg: ResolvedConfig, sharing=None, control=None) -> float:
    return make_trainer(cfg, sharing=sharing, control=control).train()


def make_trainer(cfg: ResolvedConfig, rehearse=None, sharing=None, control=None):
    """This rank's Trainer from a resolved config, everything built and resumed, ready to train().
    `rehearse` (parallel.Rehearsal): play that rank of its world alone, under the fake process group,
    which the caller has started (`with rehearse.started(...)`); `sharing` (parallel.DeviceSharing): the
    node's ranks on one GPU, as that object arranges. `control` (train.stop.RunControl): the stop
    requests and phase the worker shares with the loop (one with the signal handlers installed when not
    given)."""
    import torch
    from megatron.core import parallel_state

    from angelgpt import parallel
    from angelgpt.config import ConfigError
    from angelgpt.data.dataset import build_datasets
    from angelgpt.data.tokenizer import MockTokenizer, check_vocabulary, load_tokenizer
    from angelgpt.planner import beside_store_bytes
    from angelgpt.train.loop import Trainer
    from angelgpt.train.stop import RunControl

    logging.getLogger("megatron.core.datasets").setLevel(logging.ERROR)  # index-cache chatter on stderr
    if control is None:  # before anything slow: a signal during set-up stops at the first boundary
        control = RunControl().install_signal_handlers()
    on_gpu = cfg.train.device == "cuda"
    cfg.check_device(on_gpu)
    if on_gpu and not torch.cuda.is_available():
        raise ConfigError("train.device is 'cuda' but no CUDA GPU is visible")
    world = rehearse.world_size if rehearse else int(os.environ.get("WORLD_SIZE", "1"))
    cfg.data_parallel_size(world)
    if rehearse is None:
        parallel.initialize(cfg.parallel.tensor_model_parallel_size, cfg.parallel.pipeline_model_parallel_size,
                            on_gpu, cfg.parallel.distributed_timeout_minutes, sharing)
    setup_logging()
    if rehearse is None and int(os.environ.get("WORLD_SIZE", "1")) > int(os.environ.get("LOCAL_WORLD_SIZE", "1")):
        cfg = follow_rank0(cfg)  # several nodes, a launcher each: every rank builds from node 0's resolution
    torch.manual_seed(cfg.train.seed)
    if on_gpu:
        from megatron.core import tensor_parallel

        tensor_parallel.model_parallel_cuda_manual_seed(cfg.train.seed)
    else:
        torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))

    tokenizer = MockTokenizer(cfg.model.vocab_size) if cfg.data.is_mock else load_tokenizer(cfg.data.tokenizer)
    check_vocabulary(tokenizer, cfg)
    reserve = beside_store_bytes(cfg, cfg.data_parallel_size(world),
                                 parallel_state.get_pipeline_model_parallel_rank())
    model, optimizer, scheduler = build(cfg, on_gpu, reserve if on_gpu else 0, rehearsal=rehearse is not None)
    summary = optimizer.summary()
    if summary:
        log.info(summary)
    if on_gpu:
        log.info(f"built model and optimizer: GPU {torch.cuda.memory_allocated() / 2**30:.2f} GiB allocated")
    gb = cfg.train.global_batch_size
    valid_samples = cfg.train.eval_iters * gb if cfg.train.eval_interval else 0
    train_ds, valid_ds = build_datasets(cfg, tokenizer, cfg.train.train_iters * gb, valid_samples)
    trainer = Trainer(cfg, model, optimizer, scheduler, train_ds, valid_ds, on_gpu, control,
                      rehearsal=rehearse is not None, sharing=sharing)
    trainer.maybe_resume()
    log.info(f"training from iteration {trainer.iteration} to {cfg.train.train_iters} "
             f"(DP={parallel_state.get_data_parallel_world_size()}, "
             f"TP={cfg.parallel.tensor_model_parallel_size}, PP={cfg.parallel.pipeline_model_parallel_size}, "
             f"device={'cuda' if on_gpu else 'cpu'})")
    return trainer


def main(argv=None, sharing=None) -> int:
    """The worker's entry: `--run-config PATH`, the resolved run config (`read_run_config`); bad input
    is one line from rank 0 and exit code 2. `sharing` (parallel.DeviceSharing): the node's ranks on one
    GPU, as that object arranges."""
    from angelgpt.train.lifetime import watch_launcher

    watch_launcher()  # a worker of `angelgpt train` ends when the launcher does, SIGKILL included
    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    from angelgpt.config import ConfigError
    from angelgpt.train.stop import RunControl

    control = RunControl().install_signal_handlers()
    try:
        cfg = read_run_config(sys.argv[1:] if argv is None else argv)
        run(cfg, sharing=sharing, control=control)
    except ConfigError as exc:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"angelgpt: error: {exc}", file=sys.stderr, flush=True)
        return 2
    except Exception as exc:
        from angelgpt import parallel
        from angelgpt.train.loop import TrainingAborted

        if parallel.is_timeout(exc):  # every rank that gave up says so: the silent one is the culprit
            report = next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
            print(f"angelgpt: rank {os.environ.get('RANK', '0')}: a collective timed out after "
                  f"{cfg.parallel.distributed_timeout_minutes:g} min (parallel.distributed_timeout_minutes) during "
                  f"{control.phase}; another rank stopped answering ({report[:200]})", file=sys.stderr, flush=True)
            return 1
        if not isinstance(exc, TrainingAborted):
            raise
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"angelgpt: training aborted: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        from angelgpt import parallel

        parallel.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
