"""ZeRO-Cache: model states sharded over data-parallel ranks in one store over device, host and NVMe."""

from angelgpt.zero_cache.optimizer import ZeroCacheOptimizer

__all__ = ["ZeroCacheOptimizer"]
