"""Memory and time planner: does a configuration fit, where does each state go, what bounds its speed.

Shared by `angelgpt plan`, `angelgpt train` (which refuses what will not fit) and ZeRO-Cache's
`prefetch_cache_sub_group_rate: auto`. Torch-free except `auto_settings`, which reads the device.
"""

from angelgpt.planner.plan import MACHINES, Machine, SystemPlan, auto_plan, auto_settings, machine_from, plan

__all__ = ["MACHINES", "Machine", "SystemPlan", "auto_plan", "auto_settings", "machine_from", "plan"]
