"""The measured runs the planner is judged on, kept apart from the runs that set its constants.

tests/data/planner_runs.json declares, for the committed H200 result files of benchmarks/results/,
the calibration set (each file with the planner constants it set; the planner's source names every one
of them beside its constant), the validation set (every other usable run, with any reconstruction it
needs and any quantity left unchecked, each with its reason) and the runs excluded from both (with
their reasons). Also the pattern of rehearsal reports (`angelgpt rehearse --report`),
whose ranks are checked against the prediction recorded beside them.

Owns: `declared` (that file), `config_of` (the config a bench result ran, rebuilt from its command and
the settings the run printed), `measured_and_planned` (a bench result's peaks and step time beside the
plan of its config on the H200's figures; `gpu_measured_gib` says which GPU figure), `rehearsal_points`
(a rehearsal report's ranks, measured beside predicted) and `misses` (what is off by more than TOLERANCE).
"""

import json
import re
import shlex
import statistics
from typing import Dict, List, Optional, Tuple

from angelgpt.config import parse
from angelgpt.system import GIB
from tests.helpers import ROOT

RESULTS = ROOT / "benchmarks" / "results"
DECLARED = ROOT / "tests" / "data" / "planner_runs.json"
# the planner cites its result files: its modules, and calibration.json beside each constant
PLANNER = ROOT / "angelgpt" / "planner"
PLANNER_SOURCES = sorted(PLANNER.glob("*.py")) + sorted(PLANNER.glob("*.json"))
# measured within this share of planned: peak GPU memory, host memory, step time
TOLERANCE = {"gpu": 0.10, "host": 0.10, "step": 0.15}


def declared() -> dict:
    return json.loads(DECLARED.read_text())


def result(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


def _settled(settings: List[str]) -> List[str]:
    """Overrides for what a run printed it settled: the launcher's 'resolved:' line, then the workers'
    own recompute choice and the optimizer's placement (what ran, where they differ from the launcher)."""
    out: List[str] = []
    for line in settings:
        if line.startswith("resolved: "):
            out += [w.strip() for w in line[len("resolved: "):].split(",") if "=" in w]
        m = re.match(r"model\.recompute auto: full, the first (\d+) layers", line)
        if m:
            out += ["model.recompute=full", f"model.recompute_num_layers={m.group(1)}"]
        m = re.match(r"zero_cache: prefetch_cache_sub_group_rate ([\d.]+), offload_params (\w+)", line)
        if m:
            out += [f"zero_cache.prefetch_cache_sub_group_rate={m.group(1)}",
                    f"zero_cache.offload_params={m.group(2).lower()}"]
            frac = re.search(r"\(device_update_fraction ([\d.]+)\)", line)
            if frac:
                out.append(f"zero_cache.device_update_fraction={frac.group(1)}")
    return out


def config_of(run: dict, overrides: Tuple[str, ...] = ()):
    """The config a bench result ran: its --size and KEY=VALUE overrides from the recorded command, then
    what it printed it settled ('auto' resolved, the optimizer's placement; `_settled`), then `overrides`
    (a reconstruction declared beside the run). A run that recorded no settings gets the in-store
    accumulation and rate the planner chose for it (recorded under 'predicted'). A run that recorded its
    given config ('config') ran with the optim.accumulate_grads_in_fp32 it names; the runs before it
    predate that field: Megatron's optimizers added up gradients in fp32 (grad_reduce_in_fp32 on),
    ZeRO-Cache in bf16. A run that did not record optim.store_param_remainders true or 'auto' kept a
    separate fp32 master (the default before 'auto')."""
    words = shlex.split(run["command"])
    size = words[words.index("--size") + 1]
    given = [w for w in words if "=" in w and not w.startswith("-")]
    settled = _settled(run.get("settings") or [])
    chosen = run.get("predicted") or {}
    if not settled:
        if not any(w.startswith("zero_cache.accumulate_in_store=") for w in given):
            settled.append(f"zero_cache.accumulate_in_store={'true' if chosen.get('accumulate_in_store') else 'false'}")
        if "zero_cache.prefetch_cache_sub_group_rate=auto" in given and chosen.get("rate") is not None:
            settled.append(f"zero_cache.prefetch_cache_sub_group_rate={chosen['rate']}")
    words = [*given, *settled, "model.activation_offload=none", *overrides]
    cfg = parse(size, overrides=words)
    optim = (run.get("config") or {}).get("optim") or {}  # what the run recorded it was given
    recorded = optim.get("accumulate_grads_in_fp32")
    if recorded is None:  # before the field: fp32 for Megatron's optimizers, the model dtype for ZeRO-Cache
        recorded = cfg.optim.optimizer != "zero_cache"
    words.append(f"optim.accumulate_grads_in_fp32={str(bool(recorded)).lower()}")
    remainders = optim.get("store_param_remainders")
    if remainders not in (True, "auto") and not any(w.startswith("optim.store_param_remainders=") for w in given):
        words.append("optim.store_param_remainders=false")  # before 'auto' was the default: a separate fp32 master
    return parse(size, overrides=words)


def gpu_measured_gib(allocated_gib: float) -> float:
    """The GPU memory a run needed, as the planner counts it: the peak allocated by tensors (cuBLAS's
    workspace in it) plus the CUDA context, which no torch counter holds. Not the caching allocator's
    peak reserved: what it holds beyond allocations is cache it gives back when an allocation would
    otherwise fail (rehearse-55-a100-40gx8-gpu32.5.json: the rank that reserved 37.71 GiB under a 38.40
    GiB cap, rehearse-55-a100-40gx8-run2.json, ran its steps under a 31.50 GiB cap, its allocator freeing
    its cache and retrying 249 times), so the peak reserved says how much room there was, not how much was
    needed."""
    from angelgpt.planner.plan import CUDA_CONTEXT

    return allocated_gib + CUDA_CONTEXT / GIB


def measured_and_planned(run: dict, overrides: Tuple[str, ...] = ()) -> Tuple[dict, dict, object]:
    """(measured, planned, plan) of a bench result: peak GPU memory (gpu_measured_gib) and peak host memory
    in GiB, median step time in s; the plan on the H200's figures with the chunk size the run had (one
    chunk per layer before results recorded it). Host memory is sampled between steps, so the planner's
    in-step transient is not in it."""
    from angelgpt.planner import MACHINES, plan_for

    p = plan_for(config_of(run, (*overrides, f"zero_cache.chunk_numel={chunk_numel(run)}")), MACHINES["h200"])
    measured = {"gpu": gpu_measured_gib(run["peak_gpu_gib"]),
                "host": run["peak_host_gib"], "step": run["elapsed_ms_median"] / 1000}
    planned = {"gpu": p.gpu_total / GIB, "host": (p.host_total - p.host_bytes.get("step_transient", 0)) / GIB,
               "step": p.step_time_s}
    return measured, planned, p


def chunk_numel(run: dict) -> int:
    return (run.get("predicted") or {}).get("chunk_numel", 1 << 62)


def misses(measured: Dict[str, Optional[float]], planned: Dict[str, float], skip=()) -> Dict[str, tuple]:
    """The quantities measured off the planned value by more than TOLERANCE's share of the measured one:
    {quantity: (measured, planned)}; None measured or a quantity in `skip` is not compared."""
    out = {}
    for k, tol in TOLERANCE.items():
        if k in skip or measured.get(k) is None:
            continue
        if abs(planned[k] - measured[k]) > tol * measured[k]:
            out[k] = (round(measured[k], 3), round(planned[k], 3))
    return out


# A rehearsal runs on whatever machine rehearses the target, with its collectives faked: its step time is
# not the target's. What is compared is the median step (forward-backward plus optimizer step) of steps
# 2.. against the planner's step of the rank on the rehearsing machine, collectives left out (the report's
# step_here_s: the target's memory and layout at that machine's rates, planner.rehearsing_machine).
# Reports written before it (no step_here_s) compare the median forward-backward time with the planner's
# compute time alone on that GPU (compute_here_s); reports with neither compare memory only.


def rehearsal_points(report: dict) -> List[Tuple[str, dict, dict, Optional[str]]]:
    """Per rank of a rehearsal report: (label, measured, predicted, failure). Measured: peak GPU memory
    (gpu_measured_gib; a GPU rehearsal only) and peak RSS, in GiB; predicted: the planner's per-rank GPU total
    and host bytes recorded beside them. failure: why the rank cannot be compared (it ran out of memory
    or failed where the prediction said it fits), else None."""
    out = []
    for r in report.get("ranks", []):
        m, p = r.get("measured") or {}, r.get("predicted") or {}
        label = f"rank {r.get('rank')} ({r.get('stage', '?')} stage)"
        failure = None
        if not r.get("fits"):
            why = (r.get("ran_out") or {}).get("resource") or r.get("error") or "failed"
            failure = f"{label}: ran out ({why}) where the planner predicted it fits" if p.get("fits") else None
            if failure is None:
                continue  # predicted not to fit, and did not: nothing to compare
        gpu = gpu_measured_gib(m.get("gpu_peak_allocated_bytes", 0) / GIB)
        whole = p.get("step_here_s") is not None
        planned = p.get("step_here_s") if whole else p.get("compute_here_s")
        times = [s.get("forward_backward_s") + (s.get("optimizer_step_s") or 0.0 if whole else 0.0)
                 for s in (m.get("steps") or [])[1:] if s.get("forward_backward_s") is not None]
        step = statistics.median(times) if times and planned is not None else None
        measured = {"gpu": gpu if r.get("device") == "cuda" else None,
                    "host": m.get("host_peak_rss_bytes", 0) / GIB, "step": step}
        predicted = {"gpu": p.get("gpu_total_bytes", 0) / GIB, "host": p.get("host_per_rank_bytes", 0) / GIB,
                     "step": planned or 0.0}
        out.append((label, measured, predicted, failure))
    return out
