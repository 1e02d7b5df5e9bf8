"""angelgpt: GPT pretraining on Megatron-core with ZeRO-Cache model-state offload."""

__version__ = "0.1.0"
