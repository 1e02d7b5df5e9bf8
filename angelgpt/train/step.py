"""What Megatron's schedules call for one iteration, and what the loop wraps them in: the loss of a micro
batch, its forward, the no-pipelining schedule on CPU, the loss averaged over micro batches and ranks,
and pipeline sends and receives carried one at a time where ranks share a device."""

from __future__ import annotations

from functools import partial
from typing import Dict, List

import torch
import torch.distributed as dist
from megatron.core import parallel_state


def loss_func(loss_mask: torch.Tensor, output: torch.Tensor):
    """Mean next-token cross entropy over unmasked tokens; output is the per-token loss [b, s]."""
    mask = loss_mask.reshape(-1).float()
    loss = (output.float().reshape(-1) * mask).sum() / mask.sum().clamp(min=1.0)
    # a copy: Megatron's schedule divides the returned loss by the number of micro batches in place
    return loss, {"lm loss": loss.detach().clone()}


def forward_step(data_iterator, model, offload=None):
    """One micro batch's forward; with `offload` (angelgpt.model.offload.offload_mode) the tensors it
    selects of those the forward saves go to host memory until their backward."""
    from angelgpt.model.offload import offloading

    batch = next(data_iterator)
    with offloading(model, offload):
        output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])  # [b, s]
    return output, partial(loss_func, batch["loss_mask"])


def forward_backward_cpu(forward_step_func, data_iterator, model, num_microbatches: int,
                         forward_only: bool = False, **_) -> List[Dict[str, torch.Tensor]]:
    """Megatron's no-pipelining schedule for CPU (Megatron's own allocates on CUDA). Under sequence
    parallelism Megatron's gathers and reduce-scatters along the sequence allocate on CUDA too: forward
    and backward then run inside parallel.sequence.cpu_sequence_parallel, which keeps them on the CPU."""
    from contextlib import nullcontext

    from megatron.core.utils import get_model_config

    from angelgpt.parallel.sequence import cpu_sequence_parallel

    reduced = []
    with cpu_sequence_parallel() if get_model_config(model).sequence_parallel else nullcontext():
        for _ in range(num_microbatches):
            output, finish = forward_step_func(data_iterator, model)
            loss, stats = finish(output)
            if not forward_only:
                (loss / num_microbatches).backward()
            reduced.append(stats)
    return reduced


def mean_loss(stats: List[Dict[str, torch.Tensor]], device) -> float:
    """Mean over micro batches, then over data-parallel ranks (last pipeline stage holds the loss). One
    data-parallel rank calls no collective: its NCCL communicator would start here, after the optimizer's
    store has taken the GPU's memory (a full GPU refused NCCL 24 bytes)."""
    if not parallel_state.is_pipeline_last_stage():
        return float("nan")
    loss = torch.stack([s["lm loss"] for s in stats]).mean().to(device)
    dp = parallel_state.get_data_parallel_world_size()
    if dp > 1:
        dist.all_reduce(loss, group=parallel_state.get_data_parallel_group())
    return loss.item() / dp


def shared_p2p(forward_backward, model, sharing):
    """Megatron's forward-backward with its pipeline sends and receives carried by `sharing`
    (parallel.DeviceSharing: one tensor at a time, batch_p2p_comm off in the model's config)."""
    from megatron.core.utils import get_model_config

    config = get_model_config(model)
    config.batch_p2p_comm = False
    sharing.check_pipeline_config(config)

    def run(**kwargs):
        with sharing.pipeline_p2p():
            return forward_backward(**kwargs)

    return run
