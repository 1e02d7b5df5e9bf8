"""One figure of a result file, for the notes of BENCHMARKS.md (benchmarks/BENCHMARKS.md.template).

A note's every figure is read from a result file by `Figures` and followed by that file's name in
backticks (`f.cite`). The rule the test holds the notes to (tests/unit/test_bench_report.py): every
number of a note outside code spans appears in the first result file named after it. So a figure is
written in the unit its file holds (TFLOP/s, GiB, ms, fractions as fractions), a ratio of two files is
left to the goal table, and a claim no committed file holds is not made. A note names a case (a file's
name without `.json`); the newest run of that case fills it; a file's name with `.json` names that run
of its case.
"""

from __future__ import annotations

import re
import statistics

from benchmarks.results import case_of

# key: (pattern in the run's settings lines, the prediction's field otherwise, the type)
SETTLED = {"rate": (r"^zero_cache: prefetch_cache_sub_group_rate ([\d.]+)", "predicted.rate", 0.0),
           "device_update_fraction": (r"^zero_cache: .*device_update_fraction ([\d.]+)\)",
                                      "predicted.device_update_fraction", 0.0),
           "planned_step_s": (r"^plan: .*predicted ([\d.]+) s per step", "predicted.step_time_s", 0.0),
           "recomputed": (r"^model.recompute auto: full, the first (\d+) layers", None, 0)}
ALIASES = {"tflops": "tflops_per_gpu_median", "gpu": "peak_gpu_gib", "host": "peak_host_gib",
           "reserved": "peak_gpu_reserved_gib", "step_ms": "elapsed_ms_median"}
# figures read from the log's tail, by name: benchmarks.deepspeed_peer's host peak when training starts
LOGGED = {"startup_host_peak": r"training \(host peak ([\d.]+) GiB\)"}


def value(r: dict, key: str):
    """One figure of a result file: a field (dotted for nested ones, a list's item by its index; aliases
    above), `arg:KEY` (the last value the command gave KEY), `profile.KEY` (median after warm-up of
    ZeRO-Cache's per-step profile), `log:REGEX` (its first group in the log's tail; LOGGED names some),
    `refused:gpu`/`refused:host` (what the planner found short), `rate`, `device_update_fraction`,
    `planned_step_s` and `recomputed` (how many layers recompute) as the run settled them, or as the
    planner predicted them in files that predate `settings`."""
    if key in LOGGED:
        key = "log:" + LOGGED[key]
    if key.startswith("arg:"):
        found = re.findall(rf"(?:^| ){re.escape(key[4:])}=(\S+)", r.get("command", ""))
        if not found:
            raise KeyError(key)
        return found[-1]
    if key.startswith("profile."):
        steady = [x["zero_cache_profile"] for x in r.get("records", [])[r.get("warmup_iters", 0):]
                  if x.get("zero_cache_profile")]
        return statistics.median(p[key[len("profile."):]] for p in steady)
    if key.startswith("log:"):
        return float(re.search(key[4:], r.get("log_tail", "")).group(1))
    if key.startswith("refused:"):
        return float(re.search(rf"{key[8:]} by ([\d.]+) GiB", r["refused"]).group(1))
    if key in SETTLED:  # what the run settled (its `settings` lines) where recorded, else the planner's
        for line in r.get("settings", []):
            found = re.search(SETTLED[key][0], line)
            if found:
                return type(SETTLED[key][2])(found.group(1))
        return value(r, SETTLED[key][1]) if key != "recomputed" else \
            int(re.search(r"first (\d+) layers", r["predicted"]["recompute"]).group(1))
    out = r
    for part in ALIASES.get(key, key).split("."):
        out = out[int(part)] if isinstance(out, list) else out[part]  # records.-1.lm_loss: the last record's
    return out


def in_store(r: dict) -> bool:
    """Whether a run accumulated its micro batches' gradients in ZeRO-Cache's store, as it settled it
    or, in files that predate `settings`, as given or planned."""
    said = [line for line in r.get("settings", []) if "accumulate_in_store" in line]
    if said:
        return "accumulate_in_store=true" in said[-1] or "accumulate_in_store True" in said[-1]
    return "zero_cache.accumulate_in_store=true" in r.get("command", "") or \
        (r.get("predicted") or {}).get("accumulate_in_store") is True


class Figures:
    """f(case, key, format) is a figure of the newest run of `case`; f.cite(case, ...) names the files
    the figures before it come from; f.layers(case) and f.mb(case) read the command; f.in_store(case)
    says whether the run accumulated in the store. A case no file holds, or a figure its file lacks,
    raises KeyError (the note is then left out)."""

    def __init__(self, cases: dict):
        self.cases = cases  # {case: [(path, result), ...]}, oldest first

    def run(self, case: str):
        if case.endswith(".json"):  # that run of its case, not the newest
            found = [fr for fr in self.cases.get(case_of(case), []) if fr[0].name == case]
            if not found:
                raise KeyError(case)
            return found[0]
        if case not in self.cases:
            raise KeyError(case)
        return self.cases[case][-1]

    def __call__(self, case: str, key: str, form: str = "{:.1f}") -> str:
        path, r = self.run(case)
        try:
            return form.format(value(r, key))
        except (LookupError, AttributeError, TypeError, ValueError, statistics.StatisticsError):
            raise KeyError(f"{key} in {path.name}") from None

    def layers(self, case: str) -> str:
        return self(case, "arg:model.num_layers", "{}")

    def mb(self, case: str) -> str:
        return self(case, "arg:train.micro_batch_size", "{}")

    def cite(self, *cases: str) -> str:
        return "(" + ", ".join(f"`{self.run(c)[0].name}`" for c in cases) + ")"

    def in_store(self, case: str) -> bool:
        return in_store(self.run(case)[1])
