"""The optimizer contract every angelgpt optimizer keeps, and the math they share.

    from angelgpt.optimizer import Optimizer, clip_coefficient, no_weight_decay

The training loop, checkpoints and the worker depend on it; each optimizer (Megatron's behind an
adapter, the CPU data-parallel AdamW, ZeRO-Cache's front) keeps it. The shared math is Megatron's rules as
ZeRO-Cache keeps them (angelgpt.zero_cache.rules), which imports nothing of angelgpt: angelgpt/zero_cache/
never imports this package.
"""

from angelgpt.optimizer.base import Optimizer, clip_coefficient, no_weight_decay

__all__ = ["Optimizer", "clip_coefficient", "no_weight_decay"]
