"""BENCHMARKS.md and benchmarks/peers.png from the peer result files (`scripts/bench_peers.py report`).

What it owns: reading the result files under benchmarks/results/ (the newest run of each case; a case
run again is NAME-runN.json beside NAME.json, and the earlier runs get a table of their own), the
tables (runs, largest size per system, goals, ZeRO-Cache's time profile), the same-call check behind
every goal ratio (two files compare only when they share `call` and `machine`: scripts/bench_train.py
records both), how each run's micro batches' gradients added up (ZeRO-Cache's runs before commit da83288
added up in bf16; `optim.accumulate_grads_in_fp32`, fp32, is the default since: a system's largest size
and the goals take runs of the default, the bf16 runs are shown as the opt-out's), and the notes: each note a template whose every figure is read from the result file
named beside it (in backticks, after the figures it holds), so that no figure outlives its file.
Notes live in scripts/bench_notes.py.
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from scripts.bench_notes import NOTES, Figures  # noqa: E402
from scripts.bench_peers import LABEL, SYSTEMS  # noqa: E402

NOTABLE = ("model.recompute", "zero_cache.prefetch_cache_sub_group_rate", "optim.offload_fraction",
           "zero_cache.accumulate_in_store", "zero_cache.offload_params", "zero_cache.device_update_fraction",
           "zero_cache.nvme_path", "zero_cache.cpu_adam", "optim.accumulate_grads_in_fp32")


# commit da83288 made optim.accumulate_grads_in_fp32 (true) the default; ZeRO-Cache's runs before it added up
# micro batches' gradients in bf16, Megatron's optimizers always in fp32 (grad_reduce_in_fp32)
FP32_SUMS_SINCE = "2026-12-04T05:38:52Z"
SUMS = {"fp32": "fp32", "bf16": "bf16 (`optim.accumulate_grads_in_fp32=false`; the default before da83288)",
        "none": "none (one micro batch a step)", None: "-"}


def sums(r: dict, system: str, mb: int, gb: int):
    """How a run's micro batches' gradients added up: 'none' (one micro batch a step), 'fp32' or 'bf16' as
    its config or command gave it, else as the default was on its date; None for DeepSpeed's runs."""
    if system.startswith("deepspeed"):
        return None
    if gb // mb == 1:
        return "none"
    given = ((r.get("config") or {}).get("optim") or {}).get("accumulate_grads_in_fp32")
    said = re.findall(r"(?:^| )optim\.accumulate_grads_in_fp32=(\S+)", r.get("command", ""))
    if given is None and said:
        given = said[-1].lower() in ("true", "1", "yes")
    if given is None:
        given = system.startswith("megatron") or r.get("date", "") >= FP32_SUMS_SINCE
    return "fp32" if given else "bf16"


def case_of(path: Path) -> str:
    return re.sub(r"-run\d+$", "", path.stem)


def runs_by_case(results: Path, pattern: str = "*.json") -> dict:
    """{case: [(path, result), ...]} oldest first: by date, then by run number."""
    cases: dict = {}
    for f in sorted(results.glob(pattern)):
        try:
            r = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(r, dict):
            cases.setdefault(case_of(f), []).append((f, r))
    for runs in cases.values():
        runs.sort(key=lambda fr: (fr[1].get("date", ""), int((re.findall(r"-run(\d+)$", fr[0].stem) or [1])[0])))
    return cases


def same_call(a: dict, b: dict) -> str:
    """'same call' when two result files share the device call and the machine, 'different calls'
    when they do not, 'call unknown' when either predates the `call` record."""
    if not a.get("call") or not b.get("call"):
        return "call unknown"
    ma, mb = a.get("machine") or {}, b.get("machine") or {}
    machine = all(ma.get(k) == mb.get(k) for k in ("host", "boot_id", "gpu", "gpu_uuid"))
    return "same call" if a["call"] == b["call"] and machine else "different calls"


def settings(r: dict) -> str:
    """The notable overrides a run used (the last value of each key), and the given gradient
    accumulation dtype where the file records the config, for the tables."""
    found = {}
    for word in r.get("command", "").split():
        key, _, value = word.partition("=")
        if key in NOTABLE:
            found[key.split(".")[-1]] = value
        elif key.startswith("deepspeed."):  # scripts/bench_deepspeed.py's own keys
            found[key.removeprefix("deepspeed.").removeprefix("zero_optimization.")] = value
    fp32 = ((r.get("config") or {}).get("optim") or {}).get("accumulate_grads_in_fp32")
    if fp32 is not None and "accumulate_grads_in_fp32" not in found:
        found["accumulate_grads_in_fp32"] = str(fp32).lower()
    return ", ".join(f"{k}={v}" for k, v in found.items()) or "-"


def row(f: Path, r: dict) -> dict:
    system, rest = r["name"][len("peers-"):].rsplit("-L", 1)
    records = r.get("records", [])
    profiles = [x["zero_cache_profile"] for x in records[r.get("warmup_iters", 0):] if x.get("zero_cache_profile")]
    mb, gb = (int(x[2:]) for x in rest.split("-")[1:3])
    return dict(file=f.name, raw=r, system=system, layers=int(rest.split("-")[0]), mb=mb, gb=gb,
                ok=r["returncode"] == 0 and len(records) >= 3, steps=len(records), params=None,
                tflops=r.get("tflops_per_gpu_median"), tokens=r.get("tokens_per_s_median"),
                gpu=r.get("peak_gpu_gib"), host=r.get("peak_host_gib"), oom=r.get("oom"),
                oom_kind=r.get("oom_kind"), refused=r.get("refused"), commit=r.get("commit", "")[:10],
                date=r.get("date", ""), call=r.get("call") or "unknown", step_ms=r.get("elapsed_ms_median"),
                profile={k: statistics.median(p[k] for p in profiles) for k in profiles[0]} if profiles else None,
                settings=settings(r), sums=sums(r, system, mb, gb))


def outcome(r) -> str:
    """Why a run completed no step, for the runs table: out of memory, or refused by the planner."""
    if r["refused"]:
        return f" (refused: {r['refused']})"
    return f" (OOM: {r['oom_kind'] or 'gpu'})" if r["oom"] else ""


def fmt(v, f):
    return f.format(v) if v is not None else "-"


def current(r) -> bool:
    """Whether a run trained as the default trains now (not with bf16 sums)."""
    return r["sums"] != "bf16"


def run_line(r, extra: str = "") -> str:
    return (f"| {LABEL.get(r['system'], r['system'])} | {r['layers']} | {r['params'] / 1e9:.2f}B | {r['mb']} / "
            f"{r['gb']} | {r['settings']} | {SUMS[r['sums']].split(' (')[0]} | {r['steps']}{outcome(r)} | {fmt(r['tflops'], '{:.1f}')} | "
            f"{fmt(r['tokens'], '{:,.0f}')} | {fmt(r['gpu'], '{:.1f}')} | {fmt(r['host'], '{:.1f}')} | "
            f"{r['call']} | `{r['file']}` |{extra}")


def pick(xs, ys, figure):
    """The two runs a ratio is taken from: each side's best within the newest device call that has
    runs on both sides; without one, each side's best overall (the goal table then says why it is
    not a goal result)."""
    calls: dict = {}
    for x in xs:
        for y in ys:
            if same_call(x["raw"], y["raw"]) == "same call":
                calls.setdefault(x["raw"]["call"], set()).update({id(x), id(y)})
    if calls:
        newest = max(calls, key=lambda c: max(r["date"] for r in xs + ys if id(r) in calls[c]))
        xs, ys = ([r for r in side if id(r) in calls[newest]] for side in (xs, ys))
    return max(xs, key=figure), max(ys, key=figure)


def goals_table(rows, best, best_any, opt_out) -> list:
    """The goal lines: ZeRO-Cache's runs of the default (fp32 sums) at the peers' global batch, then its
    largest at any global batch and its bf16-sum opt-out's largest, each said so."""
    out = []

    def line(what, goal, x, y=None, constant=None):
        if x is None or (y is None and constant is None):
            out.append(f"| {what} | {goal:.2f}x | not measured | - | - | - |")
            return
        if y is None:
            value, check, files = x["params"] / constant, "one run", f"`{x['file']}`"
        else:
            key = "params" if what.startswith("size") else "tflops"
            value, check, files = x[key] / y[key], same_call(x["raw"], y["raw"]), f"`{x['file']}` / `{y['file']}`"
        verdict = ("met" if value >= goal else "missed") if check in ("same call", "one run") else "not a goal result"
        out.append(f"| {what} | {goal:.2f}x | {value:.2f}x | {verdict} | {files} | {check} |")

    def ok(system, layers=None, gb=None, speed=False, default=True):
        return [r for r in rows if r["system"] == system and r["ok"] and (layers is None or r["layers"] == layers)
                and (gb is None or r["gb"] == gb) and (r["tflops"] if speed else True) and current(r) == default]

    def speed(what, goal, xs, ys):
        x, y = pick(xs, ys, lambda r: r["tflops"]) if xs and ys else (None, None)
        line(what, goal, x, y)

    a = best.get("megatron")
    gb = a["gb"] if a else None
    at_gb = f" at global batch {gb}" if gb else ""
    for peer in ("megatron", "deepspeed_zero3_offload"):
        p = best.get(peer)
        xs, ys = ok("zero_cache", gb=p and p["gb"]), ok(peer)
        x, y = pick(xs, ys, lambda r: r["params"]) if p and xs and ys else (None, None)
        layers = f", {x['layers']} / {y['layers']} layers" if x and y else ""
        line(f"size: (d) / {LABEL[peer][:3]} (global batch {p['gb'] if p else '-'}{layers})",
             {"megatron": 2.0}.get(peer, 1.9), x, y)
    d, d_any = best.get("zero_cache"), best_any.get("zero_cache")
    line(f"size: (d) / 16B{at_gb}" + (f" ({d['layers']} layers)" if d else ""), 1.0, d, constant=16e9)
    if d_any and d_any is not d:
        line(f"size: (d) / 16B at global batch {d_any['gb']}, one micro batch a step ({d_any['layers']} layers)",
             1.0, d_any, constant=16e9)
    line("size: (e) / 19B", 1.0, best_any.get("zero_cache_nvme"), constant=19e9)
    for peer, goal in (("megatron", 0.97), ("deepspeed_zero3_offload", 2.0), ("megatron_cpu_offload", 1.2)):
        p = best.get(peer)
        speed(f"speed: (d) / {LABEL[peer][:3]} at {LABEL[peer][:3]}'s largest measured size"
              + (f" ({p['layers']} layers)" if p else ""), goal,
              ok("zero_cache", p and p["layers"], speed=True) if p else [], ok(peer, p and p["layers"], speed=True))
    a_runs = ok("megatron", a["layers"], speed=True) if a else []
    speed(f"speed: (d) at its largest{at_gb} / (a) at its largest" + (f" ({d['layers']} / {a['layers']} layers)"
                                                                      if d and a else ""), 0.75,
          ok("zero_cache", d["layers"], d["gb"], speed=True) if d else [], a_runs)
    if d_any and d_any is not d:
        speed(f"speed: (d) at its largest at global batch {d_any['gb']}, one micro batch a step "
              f"({d_any['layers']} layers) / (a) at its largest", 0.75,
              ok("zero_cache", d_any["layers"], d_any["gb"], speed=True), a_runs)
    o = opt_out.get("zero_cache")
    if o:
        speed(f"speed: (d) with bf16 sums, the opt-out, at its largest at global batch {o['gb']} ({o['layers']} "
              "layers) / (a) at its largest", 0.75,
              ok("zero_cache", o["layers"], o["gb"], speed=True, default=False), a_runs)
    return out


def profile_table(rows) -> list:
    profiled = sorted((r for r in rows if r["profile"]), key=lambda r: (r["layers"], r["gb"]))
    if not profiled:
        return []
    out = ["## ZeRO-Cache time profile (median per step after warm-up, `is_communication_time_profiling`)", "",
           "| layers | micro / global batch | commit | step ms | D2H ms (GB) | weight fetch ms (GB) | "
           "in-store accumulation round trips ms (GB) | host states updated by the CPU ms (of it AdamW) | "
           "host states updated on the GPU ms (GB over PCIe) | exposed: waiting for the update ms | "
           "waiting for a fetch ms | waiting for an accumulation slot ms |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in profiled:
        p = r["profile"]
        out.append(f"| {r['layers']} | {r['mb']} / {r['gb']} | {r['commit'][:7]} | {r['step_ms']:.0f} | "
                   f"{p['d2h_ms']:.0f} ({p.get('d2h_gb', 0):.1f}) | {p['fetch_ms']:.0f} ({p.get('fetch_gb', 0):.1f}) | "
                   f"{p.get('accumulate_ms', 0):.0f} ({p.get('accumulate_gb', 0):.1f}) | "
                   f"{p['update_thread_ms']:.0f} ({p['cpu_optimizer_ms']:.0f}) | "
                   f"{p.get('device_update_thread_ms', 0):.0f} ({p.get('device_update_gb', 0):.1f}) | "
                   f"{p['exposed_wait_update_ms']:.0f} | {p['exposed_wait_fetch_ms']:.0f} | "
                   f"{p.get('exposed_wait_slot_ms', 0):.0f} |")
    return out + [""]


def notes(cases) -> list:
    """The notes, each filled from the newest run of the cases it names; a note whose file is
    missing is left out (and said so on stderr)."""
    fig, out = Figures(cases), []
    for note in NOTES:
        try:
            out.append("- " + note(fig))
        except KeyError as exc:
            print(f"bench_report: note '{note.__name__}' left out: no {exc.args[0]}", file=sys.stderr)
    return out


def generate(results: Path):
    """(BENCHMARKS.md's text, the data of the chart)."""
    from angelgpt.config import resolve
    from angelgpt.model.flops import num_params

    cases = runs_by_case(results)
    peers = {c: runs for c, runs in cases.items() if c.startswith("peers-")}
    rows, earlier = [], []
    for case in sorted(peers):
        *older, newest = peers[case]
        rows.append(row(*newest))
        earlier += [(row(*run), newest[0].name) for run in older]
    for r in rows + [e for e, _ in earlier]:
        r["params"] = num_params(resolve("h200-16b", overrides=[f"model.num_layers={r['layers']}"]))
    # each system's largest completed size as it trains by default: at the global batch of Megatron's largest
    # (every peer's), else at any; ZeRO-Cache's largest at any global batch and with bf16 sums beside it
    done = [r for r in rows if r["ok"]]
    largest = lambda sys_, keep: max((r for r in done if r["system"] == sys_ and keep(r)),  # noqa: E731
                                     key=lambda r: (r["layers"], r["gb"]), default=None)
    best_any = {s: b for s in SYSTEMS if (b := largest(s, current))}
    a = best_any.get("megatron")
    best = {s: largest(s, lambda r: current(r) and a and r["gb"] == a["gb"]) or b for s, b in best_any.items()}
    opt_out = {s: b for s in SYSTEMS if (b := largest(s, lambda r: not current(r)))}
    head = ("| system | layers | params | micro / global batch | settings | gradient sums | completed steps | "
            "model TFLOP/s/GPU | tokens/s | peak GPU GiB | peak host GiB | device call | result file |")
    lines = ["# Benchmarks: one H200, the 55 preset's layer shape with varying layers", "",
             "Every figure below is read from a result file under `benchmarks/results/` (written by "
             "`scripts/bench_peers.py run`, which records the exact command, commit, machine and device call); "
             "this file and `benchmarks/peers.png` are regenerated by `python scripts/bench_peers.py report`.", "",
             "## Runs", "", "The newest run of each case (a case run again is `NAME-runN.json` beside `NAME.json`; "
             "the earlier runs follow). `device call`: the call a file records, `unknown` for files written "
             "before runs recorded it. `gradient sums`: the dtype the micro batches' gradients added up in "
             "(`optim.accumulate_grads_in_fp32`, fp32 by default since commit da83288; ZeRO-Cache's runs before "
             "it added up in bf16, as the opt-out `optim.accumulate_grads_in_fp32=false` does; Megatron's "
             "optimizers always added up in fp32), `none` with one micro batch a step.", "",
             head, "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    order = lambda r: (r["system"], r["layers"], r["gb"])  # noqa: E731
    lines += [run_line(r) for r in sorted(rows, key=order)]
    if earlier:
        lines += ["", "### Earlier runs of a case", "", head + " newest run |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        lines += [run_line(r, f" `{newest}` |") for r, newest in sorted(earlier, key=lambda e: order(e[0]))]
    lines += ["", "## Largest model that completes 3 optimizer steps", "",
              "Each system as it trains by default, at the global batch of the peers' runs; ZeRO-Cache also at "
              "the other global batch it ran and with bf16 sums, the opt-out, each said so.", "",
              "| system | global batch | gradient sums | layers | params | the next size up |",
              "|---|---|---|---|---|---|"]

    def failed(r):
        """How a run that completed no step ended: 'N layers ... (micro batch M, settings)'."""
        ended = (f"were refused before launch, {r['refused']}" if r["refused"]
                 else f"ran out of {r['oom_kind'] or 'GPU'} memory")
        return (f"{r['layers']} layers {ended} (micro batch {r['mb']}"
                f"{', ' + r['settings'] if r['settings'] != '-' else ''})")

    def largest_line(label, b, keep):
        bigger = [r for r in rows if r["system"] == b["system"] and r["gb"] == b["gb"] and keep(r)
                  and r["layers"] > b["layers"]]
        nxt = min(bigger, key=lambda r: r["layers"]) if bigger else None
        gap = (f"; {b['layers'] + 1} layers not tried" if nxt and nxt["layers"] == b["layers"] + 2 else
               f"; {b['layers'] + 1} and {b['layers'] + 2} layers not tried" if nxt and nxt["layers"] == b["layers"] + 3
               else f"; {b['layers'] + 1} to {nxt['layers'] - 1} layers not tried" if nxt and nxt["layers"] > b["layers"] + 3
               else "")
        why = failed(nxt) + gap if nxt and nxt["oom"] else "not tried: the largest size is not established"
        lines.append(f"| {label} | {b['gb']} | {SUMS[b['sums']]} | {b['layers']} | {b['params'] / 1e9:.2f}B | {why} |")

    for system in SYSTEMS:
        b = best.get(system)
        if not b:
            tried = sorted((r for r in rows if r["system"] == system and r["oom"]), key=lambda r: r["layers"])
            lines.append(f"| {LABEL[system]} | - | - | {'none completed' if tried else 'not run'} | - | "
                         f"{failed(tried[0]) if tried else '-'} |")
            continue
        largest_line(LABEL[system], b, current)
        other = best_any[system]
        if other is not b:
            largest_line(f"{LABEL[system]}, global batch {other['gb']}", other, current)
        if system in opt_out:
            largest_line(f"{LABEL[system]}, bf16 sums (the opt-out)", opt_out[system], lambda r: not current(r))
    goals = goals_table(rows, best, best_any, opt_out)
    lines += ["", "## Goals", "",
              "A ratio is a goal result only when its two result files come from one device call on one "
              "machine (`same call`); `different calls` or `call unknown` (a file written before runs recorded "
              "their call) shows the ratio of each side's best run without a verdict. Where one device call "
              "has runs on both sides, the newest such call is taken. ZeRO-Cache's side is its runs of the "
              "default (fp32 sums) unless a line says otherwise.", "",
              "| goal | target | measured | | result files | device call |", "|---|---|---|---|---|---|",
              *goals, ""]
    if any("| missed |" in g for g in goals):
        lines += ["Where a goal is missed, ZeRO-Cache adds up the micro batches' gradients in fp32, as Megatron's "
                  "optimizers do and as its own runs before commit da83288 did not: each parameter's model states "
                  "in the store take 18 bytes (bf16 weight, fp32 gradient sum, fp32 master weight and two fp32 "
                  "moments) against 16 with bf16 sums, so fewer of them stay on the GPU and more are updated from "
                  "the host, and the host update and the in-store accumulation's round trips carry fp32 "
                  "gradients where they carried bf16 ones. The notes give the measured figures.", ""]
    lines += profile_table(rows)
    lines += ["## Notes", "", *notes(cases), ""]
    at = {(r["system"], r["layers"]): max((x["tflops"] for x in rows if x["system"] == r["system"] and current(x)
                                            and x["layers"] == r["layers"] and x["ok"] and x["tflops"]), default=0)
          for r in rows}
    return "\n".join(lines) + "\n", (best, at, rows)


def chart(path: Path, best, at, rows) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no chart (pip install angelgpt[bench])")
        return False
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    names = [s for s in SYSTEMS if s in best]
    ax1.bar([f"{LABEL[s][:3]}\nbatch {best[s]['gb']}" for s in names], [best[s]["params"] / 1e9 for s in names],
            color="tab:blue")
    ax1.set_ylabel("largest model (B parameters)")
    ax1.set_title("Largest size measured to complete 3 steps, one H200\n(each system's default, at its global batch)",
                  fontsize=9)
    sizes = sorted({best[s]["layers"] for s in names})
    width = 0.8 / max(1, len(names))
    for i, s in enumerate(names):
        ax2.bar([j + i * width for j in range(len(sizes))], [at.get((s, L), 0) for L in sizes], width,
                label=LABEL[s])
    ax2.set_xticks([j + width * (len(names) - 1) / 2 for j in range(len(sizes))])
    ax2.set_xticklabels([f"{L} layers" for L in sizes])
    ax2.set_ylabel("model TFLOP/s per GPU")
    ax2.set_title("Throughput at each system's largest size")
    ax2.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return True


def report(results: Path, out_dir: Path, with_chart: bool = True) -> int:
    if not results.is_dir():
        print(f"bench_peers report: no results directory '{results}'", file=sys.stderr)
        return 2
    text, (best, at, rows) = generate(results)
    (out_dir / "BENCHMARKS.md").write_text(text)
    print(f"wrote {out_dir / 'BENCHMARKS.md'}")
    if with_chart and chart(out_dir / "benchmarks" / "peers.png", best, at, rows):
        print(f"wrote {out_dir / 'benchmarks' / 'peers.png'}")
    return 0
