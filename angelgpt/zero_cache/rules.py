"""Megatron's rules that ZeRO-Cache's update keeps, and every angelgpt optimizer with it (the optimizer
package takes them from here): which parameters take weight decay, and the clipping coefficient."""


def no_weight_decay(name: str, param) -> bool:
    """Biases and 1-D parameters (norms) take no weight decay, as in Megatron."""
    return name.endswith(".bias") or param.ndim == 1


def clip_coefficient(norm: float, clip_grad: float) -> float:
    """Scale for gradients so their global norm is at most clip_grad (as Megatron and torch clip)."""
    return min(1.0, clip_grad / (norm + 1.0e-6)) if clip_grad > 0 else 1.0
