"""ZeRO-Cache: model states sharded over data-parallel ranks in one store over device, host and NVMe.

``angelgpt.optimizer.zero_cache.ZeroCacheOptimizer`` is the optimizer (the `angelgpt.optimizer.Optimizer`
contract), built from a resolved config (no 'auto' left) as a front over its parts: ``layout`` (the
frozen ownership, chunks and placement), ``buffers`` (the chunks' tensors and the shared buffers,
allocated), ``weights`` (offloaded weights, DP all-gather, forward hooks), ``gradients`` (backward
hooks, reduction to the owner, accumulation in the store, the norm), ``update`` (the pipelined step)
with ``adamw``, ``host_update`` and ``device_update`` (AdamW on device, CPU and NVMe), and ``state``
(checkpoint state).
``placement`` (torch-free) says where each chunk goes and what each tier holds, for the optimizer and
the planner alike; ``tiers`` allocates, ``pipeline`` holds the CUDA streams and the time profile,
``cpu_adam`` the one-pass CPU AdamW.
"""
