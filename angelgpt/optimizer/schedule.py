"""The learning-rate schedule of every optimizer: Megatron's OptimizerParamScheduler.

On resume the schedule (max and min lr, warmup, decay length and style) is the config's, not the
checkpoint's: Megatron's `override_opt_param_scheduler`. Only the step count comes from the
checkpoint, so a run extended with a larger train.train_iters decays over the new length from where
it stopped, as a run started with that length would.
"""

from __future__ import annotations

from typing import Optional

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
        override_opt_param_scheduler=True, use_checkpoint_opt_param_scheduler=False,
    )


# (state-dict key, what the resume line calls it) of the schedule's settings
_SETTINGS = (("lr_decay_steps", "decay over {} iterations"), ("lr_warmup_steps", "warmup {} iterations"),
             ("max_lr", "max lr {}"), ("min_lr", "min lr {}"), ("lr_decay_style", "decay style {}"))


def load_schedule(scheduler: OptimizerParamScheduler, state: dict) -> Optional[str]:
    """Loads a checkpoint's scheduler state into `scheduler` (built with the config's settings, which stay)
    and returns how the config's schedule differs from the checkpoint's, e.g. `decay over 150 iterations
    (checkpoint: 100)`, or None when it does not."""
    changed = [text.format(getattr(scheduler, key)) + f" (checkpoint: {state[key]})"
               for key, text in _SETTINGS if key in state and state[key] != getattr(scheduler, key)]
    scheduler.load_state_dict(state)
    return ", ".join(changed) or None
