"""What a rehearsal reports (`angelgpt rehearse`): each rank's measurement beside the planner's prediction
for its stage (`predicted`, `render_rank`), the machine it ran on, and the one line and exit code of
the first failure (`exit_on_failure`). No torch import at module level.
"""

from __future__ import annotations

import os
import sys
from statistics import median
from typing import List, Optional

from angelgpt.system import GIB, mem_available_bytes


def gib(b) -> str:
    """Bytes as MiB below a hundredth of a GiB, else as GiB, to two decimals."""
    b = b or 0
    return f"{b / 2 ** 20:.2f} MiB" if 0 < b < GIB // 100 else f"{b / GIB:.2f} GiB"


def predicted(p, here, pp_rank: int, target_tflops: float, here_tflops: Optional[float]) -> dict:
    """The planner's numbers for the rank on the target (`p`), plus, from `here` (the plan of the same
    rank on the rehearsing machine, planner.rehearsing_machine; None on CPU) its step there with the
    collectives left out, which a rehearsal fakes: what the measured step (forward-backward and optimizer
    step) is compared with. compute_here_s: that plan's compute alone, the target's at this GPU's rate."""
    host_rank = sum(p.host_bytes.values())
    step_here = {k: v for k, v in here.step_s.items() if k != "network"} if here is not None else None
    return {"for": f"data-parallel rank 0 of pipeline stage {pp_rank} (the planner's per-rank model)",
            "system": p.system, "fits": p.fits, "gpu_bytes": p.gpu_bytes, "gpu_total_bytes": p.gpu_total,
            "host_bytes": p.host_bytes, "host_per_rank_bytes": host_rank, "host_node_bytes": p.host_total,
            "margin_bytes": p.margin, "step_s": p.step_s, "step_time_s": p.step_time_s,
            "bottleneck": p.bottleneck, "rate": p.rate, "target_gpu_tflops": target_tflops,
            "here_gpu_tflops": here_tflops,
            "compute_here_s": step_here["compute"] if step_here else None,
            "step_here": step_here, "step_here_s": round(sum(step_here.values()), 4) if step_here else None}


def _median_after_first(values: List[float]) -> Optional[float]:
    values = [v for v in values if v is not None]
    if not values:
        return None
    return median(values[1:] if len(values) > 1 else values)


def render_rank(r: dict) -> str:
    c, m, p = r["coordinates"], r.get("measured") or {}, r.get("predicted") or {}
    on_gpu = r.get("device") == "cuda"
    verdict = "fits" if r.get("fits") else (f"RAN OUT of {r['ran_out']['resource']}" if r.get("ran_out")
                                            else "FAILED")
    lines = [f"rank {r['rank']} (node {r['node_rank']}, {r['stage']} stage: pp {c['pp_rank']}, tp {c['tp_rank']}, "
             f"dp {c['dp_rank']}) on {r.get('device', '?')}: {verdict}"]
    if on_gpu:
        lines.append(f"  GPU   peak {gib(m.get('gpu_peak_allocated_bytes'))} allocated, "
                     f"{gib(m.get('gpu_peak_reserved_bytes'))} reserved, cap {gib(r.get('gpu_cap_bytes'))}"
                     f"   | predicted {gib(p.get('gpu_total_bytes'))}")
    else:
        lines.append(f"  GPU   none (a CPU rehearsal: host memory is what is measured)   | predicted for a GPU rank "
                     f"{gib(p.get('gpu_total_bytes'))}")
    zc = m.get("zero_cache")
    tier = (f"; ZeRO-Cache host tier {gib(zc['tier_bytes'].get('host'))} ({gib(zc['host_pinned_bytes'])} pinned)"
            if zc else "")
    rss, share = m.get("host_peak_rss_bytes") or 0, r.get("host_share_bytes") or 0
    over = " (above the node's host memory per rank)" if share and rss > share else ""
    lines.append(f"  host  peak RSS {gib(rss)}{over}{tier}; node's host memory per rank {gib(share)}   "
                 f"| predicted {gib(p.get('host_per_rank_bytes'))} per rank")
    steps = m.get("steps") or []
    if steps:
        fb = _median_after_first([s["forward_backward_s"] for s in steps])
        opt = _median_after_first([s["optimizer_step_s"] for s in steps])
        step = _median_after_first([s["forward_backward_s"] + s["optimizer_step_s"] for s in steps])
        which = f"median of steps 2-{len(steps)}" if len(steps) > 2 else f"step {len(steps)}"
        here = p.get("step_here_s")
        here = (f"step {here:.4f} s on this machine (compute {p['step_here']['compute']:.4f}), "
                if here is not None else "")
        lines.append(f"  step  {step:.4f} s measured (forward-backward {fb:.4f}, optimizer step {opt:.4f}; "
                     f"{which}; collectives faked)   | predicted {here}compute "
                     f"{p.get('step_s', {}).get('compute', 0):.4f} s, step {p.get('step_time_s', 0):.4f} s on the target")
        prof = steps[-1].get("zero_cache_profile")
        if prof:
            busy = ", ".join(f"{k[:-3]} {v:.1f}" for k, v in prof.items() if k.endswith("_ms") and v
                             and not k.startswith("exposed_"))
            exposed = ", ".join(f"{k[8:-3]} {v:.1f}" for k, v in prof.items() if k.startswith("exposed_") and v)
            lines.append(f"  zero_cache profile (last step, ms): {busy or 'nothing'}; exposed: {exposed or 'none'}")
    if zc:
        lines.append(f"  {zc['summary']}")
    if r.get("ran_out"):
        lines.append(f"  ran out: {r['ran_out']['message']}")
    if r.get("error"):
        lines.append(f"  error: {r['error']}")
    return "\n".join(lines)


def this_machine(on_gpu: bool) -> dict:
    """What the rehearsal ran on: GPU name and memory, host memory and CPUs, host name."""
    import platform

    import torch

    out = {"host": platform.node(), "cpus": os.cpu_count(), "host_mem_available_bytes": mem_available_bytes()}
    if on_gpu:
        props = torch.cuda.get_device_properties(0)
        out.update(gpu=props.name, gpu_total_bytes=props.total_memory, torch=torch.__version__)
    return out


def exit_on_failure(failed: List[dict]) -> None:
    """One line on stderr and SystemExit for the first failure: 1 for an error (2 for a rank's refused
    input), 2 for memory run short."""
    ran_out = [r for r in failed if r.get("ran_out")]
    errors = [r for r in failed if not r.get("ran_out")]
    if errors:
        worst = errors[0]
        print(f"angelgpt: error: rehearsal of rank {worst['rank']} failed: {worst.get('error')}", file=sys.stderr,
              flush=True)
        raise SystemExit(2 if worst.get("exit_code") == 2 else 1)
    watched = [r for r in ran_out if r["ran_out"].get("by")]
    if watched:
        first = watched[0]
        print(f"angelgpt: error: rehearsal: rank {first['rank']} ({first['stage']} stage) "
              f"{first['ran_out']['message']}; stopped by the launcher", file=sys.stderr, flush=True)
        raise SystemExit(2)
    if ran_out:
        first = ran_out[0]
        who = ", ".join(f"rank {r['rank']} ({r['stage']} stage)" for r in ran_out)
        print(f"angelgpt: error: rehearsal: {who} ran out of {first['ran_out']['resource']}: "
              f"{first['ran_out']['message']}", file=sys.stderr, flush=True)
        raise SystemExit(2)
