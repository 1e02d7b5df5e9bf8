"""The optimizer contract every angelgpt optimizer keeps, and the math they share.

    from angelgpt.optimizer import Optimizer, clip_coefficient, no_weight_decay

Imports nothing else of angelgpt: the training loop, checkpoints and each optimizer (Megatron's behind
an adapter, the CPU data-parallel AdamW, ZeRO-Cache) depend on it, not on each other.
"""

from angelgpt.optimizer.base import Optimizer, clip_coefficient, no_weight_decay

__all__ = ["Optimizer", "clip_coefficient", "no_weight_decay"]
