"""Memory and time planner: does a configuration fit, where does each state go, what bounds its speed,
and what its 'auto' settings become on a given machine.

Shared by `angelgpt plan` and `angelgpt train` (which resolves the config once, with this machine's
reading, refuses what will not fit, and hands the workers the resolved run config).
Parts: machines (the catalogue and this machine's reading), calibration (the model's constants and
their sources), memory and timing (the model's shared terms), systemplan (a plan's totals, margins and
bottleneck), megatron, megatron_cpu_offload, zero_cache and zero3_offload (each system's plan as
configured), search (the 'auto' choices), plan (the entry points: each system's plan with 'auto'
settled), resolve (every 'auto' made concrete), layout (a rank's parameters from the config), report
(what `angelgpt plan` prints). Torch-free except `read_this_machine`, which reads the device.
"""

from angelgpt.planner.machines import (GIB, MACHINES, Machine, describe, machine_from, read_this_machine,
                                       rehearsing_machine)
from angelgpt.planner.plan import SystemPlan, auto_plan, beside_store_bytes, plan, plan_for
from angelgpt.planner.resolve import resolve_config, resolved_line

__all__ = ["GIB", "MACHINES", "Machine", "SystemPlan", "auto_plan", "beside_store_bytes", "describe",
           "machine_from", "plan", "plan_for", "read_this_machine", "rehearsing_machine", "resolve_config",
           "resolved_line"]
