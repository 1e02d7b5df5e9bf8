"""The learning-rate schedule of every optimizer: Megatron's OptimizerParamScheduler."""

from __future__ import annotations

from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from angelgpt.config import Config


def build_scheduler(optimizer, cfg: Config) -> OptimizerParamScheduler:
    """Warmup then cosine/linear/constant decay, in optimizer steps (Megatron's scheduler)."""
    o = cfg.optim
    decay = o.lr_decay_iters or cfg.train.train_iters
    return OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=o.lr, min_lr=o.min_lr,
        lr_warmup_steps=o.lr_warmup_iters, lr_decay_steps=max(decay, o.lr_warmup_iters + 1),
        lr_decay_style=o.lr_decay_style, start_wd=o.weight_decay, end_wd=o.weight_decay,
        wd_incr_steps=decay, wd_incr_style="constant",
    )
