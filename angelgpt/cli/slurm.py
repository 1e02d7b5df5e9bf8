"""The shape of a multi-node job read from Slurm's environment (`srun` sets it on every node), for
`angelgpt train` flags that were not given. No torch import here.

One launcher runs per node and starts one worker per visible GPU, so srun must start one task per
node (`srun --ntasks-per-node=1`); a step with more is refused. The worker count per node is not
read from Slurm: it is the number of GPUs the launcher sees (Slurm's CUDA_VISIBLE_DEVICES).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import List, Mapping, Optional

from angelgpt.config import ConfigError

# a port derived from the job id (when MASTER_PORT is not set): the same on every node of a job,
# most likely different for two jobs sharing a node; always in [PORT_BASE, PORT_BASE + PORT_SPAN)
PORT_BASE = 10000
PORT_SPAN = 50000

_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def hostnames(nodelist: str) -> List[str]:
    """Slurm's hostlist expression expanded, in order, as `scontrol show hostnames` does:
    `node[01-03,07],gpu-a[1-2]` -> node01 node02 node03 node07 gpu-a1 gpu-a2 (zero padding kept; several
    bracket groups in one name expand as their product, leftmost slowest). Malformed -> ConfigError."""
    text = nodelist.strip()
    if not text:
        raise ConfigError("the Slurm hostlist is empty")
    names: List[str] = []
    for item in _split_top(text, nodelist):
        names.extend(_expand(item, nodelist))
    return names


def _split_top(text: str, whole: str) -> List[str]:
    """The comma-separated items outside brackets."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise ConfigError(f"Slurm hostlist '{whole}': nested '['")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ConfigError(f"Slurm hostlist '{whole}': ']' without '['")
        elif ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    if depth:
        raise ConfigError(f"Slurm hostlist '{whole}': '[' without ']'")
    items.append(text[start:])
    if any(not item.strip() for item in items):
        raise ConfigError(f"Slurm hostlist '{whole}': an empty host name")
    return [item.strip() for item in items]


def _expand(item: str, whole: str) -> List[str]:
    """One item with zero or more bracket groups: the product of its groups' numbers."""
    start = item.find("[")
    if start < 0:
        return [item]
    end = item.index("]", start)
    prefix, rest = item[:start], item[end + 1:]
    tails = _expand(rest, whole) if rest else [""]
    return [prefix + number + tail for number in _numbers(item[start + 1:end], whole) for tail in tails]


def _numbers(ranges: str, whole: str) -> List[str]:
    """`01-03,7` -> 01 02 03 7 (a range keeps its lower bound's width)."""
    out = []
    for part in ranges.split(","):
        m = _RANGE.match(part.strip())
        if not m:
            raise ConfigError(f"Slurm hostlist '{whole}': '[{ranges}]' is not a list of numbers and "
                              f"ranges like 01-04")
        low, high = m.group(1), m.group(2) or m.group(1)
        if int(high) < int(low):
            raise ConfigError(f"Slurm hostlist '{whole}': range {low}-{high} runs backwards")
        out.extend(str(n).zfill(len(low)) for n in range(int(low), int(high) + 1))
    return out


def derived_port(job_id: int) -> int:
    return PORT_BASE + job_id % PORT_SPAN


@dataclass
class SlurmShape:
    nnodes: int
    node_rank: int
    master_addr: Optional[str]
    master_port: Optional[int]
    line: str  # what was taken, to print


def _int(env: Mapping[str, str], name: str, low: int) -> int:
    value = env.get(name, "").strip()
    if not value.isdigit() or int(value) < low:
        raise ConfigError(f"{name}={env.get(name, '')!r} in the environment is not an integer >= {low}")
    return int(value)


def from_env(env: Mapping[str, str], nnodes: Optional[int] = None, node_rank: Optional[int] = None,
             master_addr: Optional[str] = None, master_port: Optional[int] = None,
             rdzv_endpoint: Optional[str] = None) -> Optional[SlurmShape]:
    """The flags not given (None) filled in from a Slurm job's environment: SLURM_NNODES -> nnodes,
    SLURM_NODEID -> node rank, the first host of SLURM_JOB_NODELIST -> master address, MASTER_PORT else
    derived_port(SLURM_JOB_ID) -> master port; a flag given wins. None when this is not a multi-node Slurm
    job (SLURM_JOB_ID or SLURM_NNODES unset, or one node: standalone), --nnodes 1 was given, or every flag
    was given. With
    --rdzv-endpoint only the node count is taken. A step of more than one task per node, or a value that
    does not parse, raises ConfigError."""
    if not env.get("SLURM_JOB_ID") or not env.get("SLURM_NNODES"):
        return None
    job_id = _int(env, "SLURM_JOB_ID", 0)
    nodes = _int(env, "SLURM_NNODES", 1)
    if nodes == 1:
        return None
    per_node = env.get("SLURM_NTASKS_PER_NODE", "").strip()
    tasks = env.get("SLURM_NTASKS", "").strip()
    many = (f"{per_node} tasks per node (SLURM_NTASKS_PER_NODE)" if per_node.isdigit() and int(per_node) > 1
            else f"{tasks} tasks on {nodes} nodes (SLURM_NTASKS)" if tasks.isdigit() and int(tasks) > nodes else None)
    if many:
        raise ConfigError(f"this Slurm step runs {many}: `angelgpt train` runs one launcher per node, which "
                          f"starts one worker per GPU; use srun --ntasks-per-node=1")
    taken, used = [], []
    if nnodes is None:
        nnodes, taken = nodes, taken + ["SLURM_NNODES"]
    elif nnodes == 1:  # one node of the allocation, standalone
        return None
    if rdzv_endpoint:
        node_rank = 0 if node_rank is None else node_rank
    else:
        if node_rank is None:
            node_rank, taken = _int(env, "SLURM_NODEID", 0), taken + ["SLURM_NODEID"]
            if node_rank >= nnodes:
                raise ConfigError(f"SLURM_NODEID={node_rank} is not below the node count {nnodes}")
        if master_addr is None:
            listed = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
            if not listed:
                raise ConfigError("SLURM_JOB_NODELIST is not set: pass --master-addr")
            master_addr = hostnames(listed)[0]
            taken.append("SLURM_JOB_NODELIST" if env.get("SLURM_JOB_NODELIST") else "SLURM_NODELIST")
        if master_port is None:
            if env.get("MASTER_PORT"):
                master_port = _int(env, "MASTER_PORT", 1)
                taken.append("MASTER_PORT")
            else:
                master_port, taken = derived_port(job_id), taken + ["SLURM_JOB_ID"]
            if master_port > 65535:
                raise ConfigError(f"MASTER_PORT={master_port} is not a port (1-65535)")
        used = [f"rendezvous {master_addr}:{master_port}"]
    if not taken:
        return None
    line = (f"slurm: {nnodes} nodes" + ("" if rdzv_endpoint else f", node rank {node_rank}")
            + "".join(f", {u}" for u in used) + f" (from {', '.join(taken)})")
    return SlurmShape(nnodes, node_rank, None if rdzv_endpoint else master_addr,
                      None if rdzv_endpoint else master_port, line)


def fill(nnodes: Optional[int], node_rank: Optional[int], master_addr: Optional[str], master_port: Optional[int],
         rdzv_endpoint: Optional[str], env: Optional[Mapping[str, str]] = None):
    """`angelgpt train`'s (nnodes, node_rank, master_addr, master_port): those not given taken from a
    multi-node Slurm job's environment (from_env; what was taken printed in one line), else 1 node, rank 0."""
    shape = from_env(os.environ if env is None else env, nnodes, node_rank, master_addr, master_port, rdzv_endpoint)
    if shape is not None:
        print(shape.line, flush=True)
        nnodes, node_rank = shape.nnodes, shape.node_rank
        master_addr, master_port = shape.master_addr, shape.master_port
    return nnodes or 1, node_rank or 0, master_addr, master_port
