"""ZeRO-Cache: model states sharded over data-parallel ranks in one store over device, host and NVMe.

``angelgpt.zero_cache.optimizer.ZeroCacheOptimizer`` is the optimizer; ``placement`` (torch-free) says
where each chunk goes and what each tier holds, for the optimizer and the planner alike.
"""
