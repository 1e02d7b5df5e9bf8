"""What a rehearsal reports (`angelgpt rehearse`): each rank's result (`RankResult`: the rank's own report
and the launcher's figures), its measurement beside the planner's prediction for its stage
(`predicted`, `render_rank`), the machine it ran on, and the one line and exit code of the first failure
(`exit_on_failure`). No torch import at module level.
"""

from __future__ import annotations

import os
import sys
from dataclasses import asdict, dataclass, fields
from statistics import median
from typing import Dict, List, Optional

from angelgpt.system import GIB, mem_available_bytes
from angelgpt.train.rank_report import Measured, RankReport, Step


def gib(b) -> str:
    """Bytes as MiB below a hundredth of a GiB, else as GiB, to two decimals."""
    b = b or 0
    return f"{b / 2 ** 20:.2f} MiB" if 0 < b < GIB // 100 else f"{b / GIB:.2f} GiB"


@dataclass(frozen=True)
class Predicted:
    """The planner's numbers for a rehearsed rank on the target (`for_`, JSON 'for': which rank it plans),
    and on the rehearsing machine with the collectives left out (`step_here`, `step_here_s`,
    `compute_here_s`; None on the CPU): what `predicted` returns."""

    for_: str
    system: str
    fits: bool
    gpu_bytes: Dict[str, int]
    gpu_total_bytes: int
    host_bytes: Dict[str, int]
    host_per_rank_bytes: int
    host_node_bytes: int
    margin_bytes: Dict[str, int]
    step_s: Dict[str, float]
    step_time_s: float
    bottleneck: str
    rate: Optional[float]
    target_gpu_tflops: float
    here_gpu_tflops: Optional[float]
    compute_here_s: Optional[float]
    step_here: Optional[Dict[str, float]]
    step_here_s: Optional[float]

    def to_json(self) -> dict:
        return {("for" if k == "for_" else k): v for k, v in asdict(self).items()}


def predicted(p, here, pp_rank: int, target_tflops: float, here_tflops: Optional[float]) -> Predicted:
    """The planner's numbers for the rank on the target (`p`), plus, from `here` (the plan of the same
    rank on the rehearsing machine, planner.rehearsing_machine; None on CPU) its step there with the
    collectives left out, which a rehearsal fakes: what the measured step (forward-backward and optimizer
    step) is compared with. compute_here_s: that plan's compute alone, the target's at this GPU's rate."""
    step_here = {k: v for k, v in here.step_s.items() if k != "network"} if here is not None else None
    return Predicted(for_=f"data-parallel rank 0 of pipeline stage {pp_rank} (the planner's per-rank model)",
                     system=p.system, fits=p.fits, gpu_bytes=p.gpu_bytes, gpu_total_bytes=p.gpu_total,
                     host_bytes=p.host_bytes, host_per_rank_bytes=sum(p.host_bytes.values()),
                     host_node_bytes=p.host_total, margin_bytes=p.margin, step_s=p.step_s,
                     step_time_s=p.step_time_s, bottleneck=p.bottleneck, rate=p.rate,
                     target_gpu_tflops=target_tflops, here_gpu_tflops=here_tflops,
                     compute_here_s=step_here["compute"] if step_here else None, step_here=step_here,
                     step_here_s=round(sum(step_here.values()), 4) if step_here else None)


@dataclass(frozen=True)
class RankResult:
    """A rehearsed rank as `angelgpt rehearse` reports it: the rank's own report (`report`; its
    coordinates are where Megatron put it) and what the launcher knows of it: its stage kind, where it
    sits in the job (`coordinates`, `node_rank`), its GPU cap, its host memory budget (ZeRO-Cache's, the
    node's share, the watcher's limit and why), the peak RSS the watcher saw, its threads, its exit code,
    and the planner's prediction for its stage."""

    report: RankReport
    stage: str
    coordinates: Dict[str, int]
    node_rank: int
    gpu_cap_bytes: Optional[int]
    host_budget_bytes: int
    host_share_bytes: int
    host_limit_bytes: int
    host_limit: str
    host_watched_peak_rss_bytes: int
    cpu_threads: int
    exit_code: int
    predicted: Predicted

    def to_json(self) -> dict:
        """The rank's report, the launcher's fields over it: `coordinates` the launcher's."""
        own = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("report", "predicted")}
        return {**self.report.to_json(), **own, "predicted": self.predicted.to_json()}


def _median_after_first(values: List[float]) -> Optional[float]:
    values = [v for v in values if v is not None]
    if not values:
        return None
    return median(values[1:] if len(values) > 1 else values)


def render_rank(r: RankResult) -> str:
    """The rank's lines: its verdict, then each measurement beside the planner's prediction."""
    rep, c, p = r.report, r.coordinates, r.predicted
    m = rep.measured or Measured(0)  # nothing measured: the launcher knows only how the rank ended
    verdict = "fits" if rep.fits else (f"RAN OUT of {rep.ran_out.resource}" if rep.ran_out else "FAILED")
    lines = [f"rank {rep.rank} (node {r.node_rank}, {r.stage} stage: pp {c['pp_rank']}, tp {c['tp_rank']}, "
             f"dp {c['dp_rank']}) on {rep.device}: {verdict}"]
    if rep.device == "cuda":
        lines.append(f"  GPU   peak {gib(m.gpu_peak_allocated_bytes)} allocated, "
                     f"{gib(m.gpu_peak_reserved_bytes)} reserved, cap {gib(r.gpu_cap_bytes)}"
                     f"   | predicted {gib(p.gpu_total_bytes)}")
    else:
        lines.append(f"  GPU   none (a CPU rehearsal: host memory is what is measured)   | predicted for a GPU rank "
                     f"{gib(p.gpu_total_bytes)}")
    zc = m.zero_cache
    tier = (f"; ZeRO-Cache host tier {gib(zc.tier_bytes.get('host'))} ({gib(zc.host_pinned_bytes)} pinned)"
            if zc else "")
    rss, share = m.host_peak_rss_bytes, r.host_share_bytes
    over = " (above the node's host memory per rank)" if share and rss > share else ""
    lines.append(f"  host  peak RSS {gib(rss)}{over}{tier}; node's host memory per rank {gib(share)}   "
                 f"| predicted {gib(p.host_per_rank_bytes)} per rank")
    if m.steps:
        lines += _step_lines(m.steps, p)
    if zc:
        lines.append(f"  {zc.summary}")
    if rep.ran_out:
        lines.append(f"  ran out: {rep.ran_out.message}")
    if rep.error:
        lines.append(f"  error: {rep.error}")
    return "\n".join(lines)


def _step_lines(steps: List[Step], p: Predicted) -> List[str]:
    """The measured step (the median after the first) beside the planner's; ZeRO-Cache's profile of the
    last step."""
    fb = _median_after_first([s.forward_backward_s for s in steps])
    opt = _median_after_first([s.optimizer_step_s for s in steps])
    step = _median_after_first([s.forward_backward_s + s.optimizer_step_s for s in steps])
    which = f"median of steps 2-{len(steps)}" if len(steps) > 2 else f"step {len(steps)}"
    here = (f"step {p.step_here_s:.4f} s on this machine (compute {p.compute_here_s:.4f}), "
            if p.step_here_s is not None else "")
    lines = [f"  step  {step:.4f} s measured (forward-backward {fb:.4f}, optimizer step {opt:.4f}; "
             f"{which}; collectives faked)   | predicted {here}compute "
             f"{p.step_s['compute']:.4f} s, step {p.step_time_s:.4f} s on the target"]
    prof = steps[-1].zero_cache_profile
    if prof:
        busy = ", ".join(f"{k[:-3]} {v:.1f}" for k, v in prof.items() if k.endswith("_ms") and v
                         and not k.startswith("exposed_"))
        exposed = ", ".join(f"{k[8:-3]} {v:.1f}" for k, v in prof.items() if k.startswith("exposed_") and v)
        lines.append(f"  zero_cache profile (last step, ms): {busy or 'nothing'}; exposed: {exposed or 'none'}")
    return lines


def this_machine(on_gpu: bool) -> dict:
    """What the rehearsal ran on: GPU name and memory, host memory and CPUs, host name."""
    import platform

    import torch

    out = {"host": platform.node(), "cpus": os.cpu_count(), "host_mem_available_bytes": mem_available_bytes()}
    if on_gpu:
        props = torch.cuda.get_device_properties(0)
        out.update(gpu=props.name, gpu_total_bytes=props.total_memory, torch=torch.__version__)
    return out


def exit_on_failure(failed: List[RankResult]) -> None:
    """One line on stderr and SystemExit for the first failure: 1 for an error (2 for a rank's refused
    input), 2 for memory run short."""
    ran_out = [r for r in failed if r.report.ran_out]
    errors = [r for r in failed if not r.report.ran_out]
    if errors:
        worst = errors[0]
        print(f"angelgpt: error: rehearsal of rank {worst.report.rank} failed: {worst.report.error}",
              file=sys.stderr, flush=True)
        raise SystemExit(2 if worst.exit_code == 2 else 1)
    watched = [r for r in ran_out if r.report.ran_out.by]
    if watched:
        first = watched[0]
        print(f"angelgpt: error: rehearsal: rank {first.report.rank} ({first.stage} stage) "
              f"{first.report.ran_out.message}; stopped by the launcher", file=sys.stderr, flush=True)
        raise SystemExit(2)
    if ran_out:
        first = ran_out[0].report.ran_out
        who = ", ".join(f"rank {r.report.rank} ({r.stage} stage)" for r in ran_out)
        print(f"angelgpt: error: rehearsal: {who} ran out of {first.resource}: {first.message}", file=sys.stderr,
              flush=True)
        raise SystemExit(2)
