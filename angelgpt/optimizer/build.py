"""The build functions the optimizer registry (angelgpt.config.optimizers) names, one per built-in
optimizer: the worker's call, `build(model, cfg, on_gpu, *, deferred, beside_store_bytes, rehearsal)
-> (model, optimizer)`, with `model` the rank's GPT model (in Megatron's Float16Module on GPU)."""

from __future__ import annotations

from angelgpt.config import ResolvedConfig


def _megatron_ddp(model, cfg: ResolvedConfig):
    """The model in Megatron's DistributedDataParallel, whose gradient buffer Megatron's optimizer steps
    from: optim.accumulate_grads_in_fp32 makes micro batches add up (and reduce) in an fp32 main_grad."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed import finalize_model_grads

    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=cfg.optim.accumulate_grads_in_fp32,
                                               overlap_grad_reduce=False, use_distributed_optimizer=True)
    model = DistributedDataParallel(config=model.config, ddp_config=ddp_config, module=model)
    model.config.finalize_model_grads_func = finalize_model_grads
    return model


def build_megatron(model, cfg: ResolvedConfig, on_gpu: bool, *, deferred: bool = False, beside_store_bytes: int = 0,
                   rehearsal: bool = False):
    """Megatron's distributed optimizer on GPU; on CPU (where it allocates on CUDA) the same math in
    CPUDataParallelAdamW."""
    if not on_gpu:
        from angelgpt.optimizer.cpu import CPUDataParallelAdamW

        return model, CPUDataParallelAdamW(model, cfg)
    from angelgpt.optimizer.megatron import build_megatron_optimizer

    model = _megatron_ddp(model, cfg)
    return model, build_megatron_optimizer(model, cfg, gloo_groups=not rehearsal)


def build_megatron_cpu_offload(model, cfg: ResolvedConfig, on_gpu: bool, *, deferred: bool = False,
                               beside_store_bytes: int = 0, rehearsal: bool = False):
    """Megatron's distributed optimizer with its CPU offload (HybridDeviceOptimizer; GPU only)."""
    from angelgpt.optimizer.megatron import build_megatron_optimizer

    model = _megatron_ddp(model, cfg)
    return model, build_megatron_optimizer(model, cfg, gloo_groups=not rehearsal, cpu_offload=True)


def build_zero_cache(model, cfg: ResolvedConfig, on_gpu: bool, *, deferred: bool = False, beside_store_bytes: int = 0,
                     rehearsal: bool = False):
    """ZeRO-Cache's optimizer over the model as it is (no DDP: it reduces the gradients itself); a
    deferred model's layers are made real as its store places them."""
    import torch

    from angelgpt.model.deferred import materializer
    from angelgpt.optimizer.zero_cache import ZeroCacheOptimizer

    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    return model, ZeroCacheOptimizer(model, cfg, device, beside_store_bytes,
                                     materialize=materializer(model, device) if deferred else None,
                                     rehearsal=rehearsal)
