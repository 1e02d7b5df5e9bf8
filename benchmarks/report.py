"""BENCHMARKS.md and benchmarks/peers.png from the peer result files.

    python scripts/bench_peers.py report [--results DIR] [--out-dir DIR] [--no-chart]
    python -m benchmarks.report ...                                    # the same

The text is benchmarks/BENCHMARKS.md.template (Jinja2), every word of it there; this module reads the
result files under benchmarks/results/ and hands the template the data: the newest run of each case (a
case run again is NAME-runN.json beside NAME.json, and the earlier runs get a table of their own), each
system's largest completed size, the goal ratios with the same-call check behind them (two files compare
only when they share `call` and `machine`: benchmarks.results records both), each run's measured steps
(its records after warm-up, which its medians are taken over: a headline figure rests on MEASURED_LEAST of
them at least, and one that rests on fewer is flagged beside it, with no verdict), how each run's micro
batches' gradients added up (ZeRO-Cache's runs before commit da83288 added up in bf16;
`optim.accumulate_grads_in_fp32`, fp32, is the default since: a system's largest size and the goals take
runs of the default, the bf16 runs are shown as the opt-out's), ZeRO-Cache's time profile, and `f`
(benchmarks.figures.Figures), from which the notes read each figure beside the file it comes from.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
from pathlib import Path

from benchmarks.figures import Figures
from benchmarks.results import RESULTS, ROOT, runs_by_case
from benchmarks.systems import LABEL, SYSTEMS

TEMPLATE = Path(__file__).resolve().parent / "BENCHMARKS.md.template"
NOTABLE = ("model.recompute", "zero_cache.prefetch_cache_sub_group_rate", "optim.offload_fraction",
           "zero_cache.accumulate_in_store", "zero_cache.offload_params", "zero_cache.device_update_fraction",
           "zero_cache.nvme_path", "zero_cache.cpu_adam", "optim.accumulate_grads_in_fp32",
           "optim.store_param_remainders", "optim.exp_avg_dtype", "optim.exp_avg_sq_dtype",
           "model.num_attention_heads", "model.kv_channels")

# a headline figure (a largest size, a speed, a goal ratio) rests on this many measured steps at least (the
# steps after warm-up, which a run's medians are taken over); one that rests on fewer is shown flagged beside
# the figure, with no verdict, and is left out of peers.png
MEASURED_LEAST = 3

# commit da83288 made optim.accumulate_grads_in_fp32 (true) the default; ZeRO-Cache's runs before it added up
# micro batches' gradients in bf16, Megatron's optimizers always in fp32 (grad_reduce_in_fp32)
FP32_SUMS_SINCE = "2026-12-04T05:38:52Z"


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
        elif key.startswith("deepspeed."):  # benchmarks.deepspeed_peer's own keys
            found[key.removeprefix("deepspeed.").removeprefix("zero_optimization.")] = value
    fp32 = ((r.get("config") or {}).get("optim") or {}).get("accumulate_grads_in_fp32")
    if fp32 is not None and "accumulate_grads_in_fp32" not in found:
        found["accumulate_grads_in_fp32"] = str(fp32).lower()
    return ", ".join(f"{k}={v}" for k, v in found.items()) or "-"


def measured_steps(r: dict) -> int:
    """The steps a result file's medians are taken over: its records after the warm-up
    (`iteration` > `warmup_iters`, as benchmarks.train takes them)."""
    warmup = int(r.get("warmup_iters") or 0)
    return sum(1 for x in r.get("records") or [] if x.get("iteration", 0) > warmup)


def row(f: Path, r: dict) -> dict:
    system, rest = r["name"].split("-", 1)[1].rsplit("-L", 1)  # FAMILY-SYSTEM-Llayers-mbM-gbG[-...]
    records = r.get("records", [])
    measured = measured_steps(r)
    profiles = [x["zero_cache_profile"] for x in records[r.get("warmup_iters", 0):] if x.get("zero_cache_profile")]
    mb, gb = (int(x[2:]) for x in rest.split("-")[1:3])
    return dict(file=f.name, raw=r, system=system, layers=int(rest.split("-")[0]), mb=mb, gb=gb,
                ok=r["returncode"] == 0 and len(records) >= 3, steps=len(records), params=None,
                warmup=int(r.get("warmup_iters") or 0), measured=measured, headline=measured >= MEASURED_LEAST,
                tflops=r.get("tflops_per_gpu_median"), tokens=r.get("tokens_per_s_median"),
                gpu=r.get("peak_gpu_gib"), host=r.get("peak_host_gib"), oom=r.get("oom"),
                oom_kind=r.get("oom_kind"), refused=r.get("refused"), commit=r.get("commit", "")[:10],
                date=r.get("date", ""), call=r.get("call") or "unknown", step_ms=r.get("elapsed_ms_median"),
                profile={k: statistics.median(p[k] for p in profiles) for k in profiles[0]} if profiles else None,
                settings=settings(r), sums=sums(r, system, mb, gb), moments=moments(r),
                shape=[w for w in r.get("command", "").split() if w.startswith("model.") and "=" in w
                       and not w.startswith("model.num_layers=")])


def moments(r: dict) -> str:
    """The dtype of Adam's moments a run kept: 'fp32' (the default, and every run before the option), or
    its optim.exp_avg_dtype / exp_avg_sq_dtype ('bf16', 'fp8'; 'bf16/fp8' where they differ)."""
    optim = (r.get("config") or {}).get("optim") or {}
    kept = {optim.get("exp_avg_dtype") or "fp32", optim.get("exp_avg_sq_dtype") or "fp32"}
    return "/".join(sorted(kept))


def current(r) -> bool:
    """Whether a run trained as the default trains now (not with bf16 sums, nor compact moments)."""
    return r["sums"] != "bf16" and r["moments"] == "fp32"


def opt_out_run(r) -> bool:
    """A run of the bf16-sum opt-out (fp32 moments)."""
    return r["sums"] == "bf16" and r["moments"] == "fp32"


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


def goal(kind: str, target: float, x=None, y=None, constant=None, **about) -> dict:
    """One goal line's data: `kind` and `about` say which (the template words it), x and y the two runs
    of a ratio (or x and a constant number of parameters), `check` whether they compare, `fewest` the
    fewer measured steps of its runs and `verdict` 'met', 'missed' or None (measured, but not a goal
    result: its runs are not of one call, or one has fewer than MEASURED_LEAST measured steps); `value`
    None when not measured."""
    g = dict(kind=kind, target=target, x=x, y=y, value=None, check=None, verdict=None, fewest=None, **about)
    if x is None or (y is None and constant is None):
        return g
    if y is None:
        g.update(value=x["params"] / constant, check="one run")
    else:
        key = "params" if kind.startswith("size") else "tflops"
        g.update(value=x[key] / y[key], check=same_call(x["raw"], y["raw"]))
    g["fewest"] = min(r["measured"] for r in (x, y) if r is not None)
    if g["check"] in ("same call", "one run") and g["fewest"] >= MEASURED_LEAST:
        g["verdict"] = "met" if g["value"] >= target else "missed"
    return g


def goals(best, best_any, opt_out, every) -> list:
    """The goals, in the table's order: ZeRO-Cache's runs of the default (fp32 sums) at the peers' global
    batch, then its largest at any global batch and its bf16-sum opt-out's largest, each said so, then
    the 28 preset's shape with the most compact states. A ratio's two runs are picked from `every` run
    (a case's earlier runs too: a peer run again in a later call still pairs with its own call's runs)."""
    out = []

    def ok(system, layers=None, gb=None, speed=False, default=True):
        return [r for r in every if r["system"] == system and r["ok"]
                and (layers is None or r["layers"] == layers) and (gb is None or r["gb"] == gb)
                and (r["tflops"] if speed else True) and (current(r) if default else opt_out_run(r))]

    def speed(kind, target, xs, ys, **about):
        x, y = pick(xs, ys, lambda r: r["tflops"]) if xs and ys else (None, None)
        out.append(goal(kind, target, x, y, **about))

    a = best.get("megatron")
    gb = a["gb"] if a else None
    for peer in ("megatron", "deepspeed_zero3_offload"):
        p = best.get(peer)
        xs, ys = ok("zero_cache", gb=p and p["gb"]), ok(peer)
        x, y = pick(xs, ys, lambda r: r["params"]) if p and xs and ys else (None, None)
        out.append(goal("size_peer", {"megatron": 2.0}.get(peer, 1.9), x, y, peer=peer, peer_best=p))
    d, d_any = best.get("zero_cache"), best_any.get("zero_cache")
    out.append(goal("size_16b", 1.0, d, constant=16e9, gb=gb, d=d))
    if d_any and d_any is not d:
        out.append(goal("size_16b_any", 1.0, d_any, constant=16e9, d=d_any))
    out.append(goal("size_19b", 1.0, best_any.get("zero_cache_nvme"), constant=19e9))
    for peer, target in (("megatron", 0.97), ("deepspeed_zero3_offload", 2.0), ("megatron_cpu_offload", 1.2)):
        p = best.get(peer)
        speed("speed_peer", target, ok("zero_cache", p and p["layers"], speed=True) if p else [],
              ok(peer, p and p["layers"], speed=True), peer=peer, peer_best=p)
    a_runs = ok("megatron", a["layers"], speed=True) if a else []
    speed("speed_largest", 0.75, ok("zero_cache", d["layers"], d["gb"], speed=True) if d else [], a_runs,
          gb=gb, d=d, a=a)
    if d_any and d_any is not d:
        speed("speed_largest_any", 0.75, ok("zero_cache", d_any["layers"], d_any["gb"], speed=True), a_runs, d=d_any)
    o = opt_out.get("zero_cache")
    if o:
        speed("speed_opt_out", 0.75, ok("zero_cache", o["layers"], o["gb"], speed=True, default=False), a_runs, d=o)
    # the 28 preset's shape (26 layers, 128 heads) with fp8 moments and bf16 sums, at global batch 8 or more
    compact = [r for r in every if r["system"] == "zero_cache" and r["ok"] and r["tflops"]
               and r["layers"] == 26 and r["gb"] >= 8 and r["moments"] == "fp8" and r["sums"] == "bf16"
               and "model.num_attention_heads=128" in r["shape"]]
    speed("speed_28", 0.35, compact, a_runs)
    return out


def largest(rows, best, best_any, opt_out) -> list:
    """The largest-size table's lines, each system in order: its largest as it trains by default at the
    peers' global batch (`run`), then at another global batch and with bf16 sums where it has those, each
    with the next size up that failed (`next`; None when none was tried); a system with none completed:
    `run` None and `tried`, its smallest failed run."""
    out = []

    def entry(system, variant, b, keep):
        bigger = [r for r in rows if r["system"] == b["system"] and r["gb"] == b["gb"] and keep(r)
                  and r["layers"] > b["layers"]]
        out.append(dict(system=system, variant=variant, run=b,
                        next=min(bigger, key=lambda r: r["layers"]) if bigger else None))

    for system in SYSTEMS:
        b = best.get(system)
        if not b:
            tried = sorted((r for r in rows if r["system"] == system and r["oom"]), key=lambda r: r["layers"])
            out.append(dict(system=system, variant=None, run=None, tried=tried[0] if tried else None))
            continue
        entry(system, None, b, current)
        if best_any[system] is not b:
            entry(system, "global batch", best_any[system], current)
        if system in opt_out:
            entry(system, "opt-out", opt_out[system], opt_out_run)
    return out


def note(name: str, caller) -> str:
    """A note of the template (`{% call note("name") %}...{% endcall %}`): its lines joined into one
    bullet; left out, and said so on stderr, when a result file or figure it names is missing."""
    try:
        return "- " + oneline(caller()) + "\n"
    except KeyError as exc:
        print(f"bench_report: note '{name}' left out: no {exc.args[0]}", file=sys.stderr)
        return ""


def oneline(text: str) -> str:
    """A paragraph of the template wrapped over lines, as one line (Markdown reads it the same)."""
    return " ".join(line.strip() for line in text.splitlines() if line.strip())


def fmt(v, form: str) -> str:
    return form.format(v) if v is not None else "-"


def code_list(items) -> str:
    return ", ".join(f"`{x}`" for x in items)


def render(**context) -> str:
    import jinja2

    env = jinja2.Environment(loader=jinja2.FileSystemLoader(TEMPLATE.parent), undefined=jinja2.StrictUndefined,
                             trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True, autoescape=False)
    env.filters.update(fmt=fmt, oneline=oneline, code_list=code_list)
    return env.get_template(TEMPLATE.name).render(note=note, **context)


def generate(results: Path):
    """(BENCHMARKS.md's text, the data of the chart)."""
    from angelgpt.config import parse
    from angelgpt.model.flops import num_params

    cases = runs_by_case(results)
    peers = {c: runs for c, runs in cases.items() if c.startswith("peers-")}
    rows, earlier, counted = [], [], []
    for case in sorted(peers):
        runs = [row(*run) for run in peers[case]]  # oldest first
        rows.append(runs[-1])
        earlier += [(r, runs[-1]["file"]) for r in runs[:-1]]
        # the sizes and goals count a case by its newest run that completed its steps (3 at least)
        counted.append(next((r for r in reversed(runs) if r["ok"]), runs[-1]))
    for r in rows + [e for e, _ in earlier]:  # the case's own shape where it changed more than the layers
        r["params"] = num_params(parse("h200-16b", overrides=[*r["shape"], f"model.num_layers={r['layers']}"]))
    text, best = _text(rows, earlier, counted, cases, llama_family(cases))
    # peers.png's speeds: headline figures only (MEASURED_LEAST measured steps or more)
    at = {(r["system"], r["layers"]): max((x["tflops"] for x in counted if x["system"] == r["system"] and current(x)
                                            and x["layers"] == r["layers"] and x["ok"] and x["headline"]
                                            and x["tflops"]), default=0)
          for r in counted}
    return text, (best, at, counted)


LLAMA_SYSTEMS = ("megatron", "zero_cache")
LLAMA_PRESET, LLAMA_SHAPE, LLAMA_3_8B = "llama3-8b", ["model.seq_length=4096"], 32


def llama_family(cases) -> dict:
    """The Llama family's part (benchmarks/peers.py --family llama, llama-SYSTEM-L... files): {rows, largest,
    goals, eight_b}: each case's newest run, each system's largest size that completed MEASURED_LEAST measured steps,
    whether each trains Llama-3-8B (32 layers), ZeRO-Cache's speed at Megatron's largest against Megatron's
    (goal 1.0x) and at its own largest against Megatron's at its largest (goal 0.75x)."""
    from angelgpt.config import parse
    from angelgpt.model.flops import num_params

    rows = []
    for case in sorted(c for c in cases if c.startswith("llama-")):
        r = row(*cases[case][-1])
        r["params"] = num_params(parse(LLAMA_PRESET, overrides=[*LLAMA_SHAPE, f"model.num_layers={r['layers']}"]))
        r["ok"] = r["ok"] and r["headline"]
        rows.append(r)
    done = {s: [r for r in rows if r["system"] == s and r["ok"] and r["tflops"]] for s in LLAMA_SYSTEMS}
    largest = {s: max(done[s], key=lambda r: r["layers"]) for s in LLAMA_SYSTEMS if done[s]}
    goals = []
    a, d = largest.get("megatron"), largest.get("zero_cache")
    for kind, target, xs in (("speed_at_megatrons_largest", 1.0,
                              [r for r in done["zero_cache"] if a and r["layers"] == a["layers"]]),
                             ("speed_at_own_largest", 0.75, [d] if d else [])):
        x, y = pick(xs, [a], lambda r: r["tflops"]) if xs and a else (None, None)
        goals.append(goal(kind, target, x, y, a=a, d=d))
    eight_b = {s: next((r for r in rows if r["system"] == s and r["layers"] == LLAMA_3_8B), None) for s in LLAMA_SYSTEMS}
    return dict(rows=sorted(rows, key=lambda r: (r["system"], r["layers"])), largest=largest, goals=goals,
                eight_b=eight_b)


def _text(rows, earlier, counted, cases, llama):
    """BENCHMARKS.md's text and each system's largest at the peers' global batch: the tables of `rows` (each
    case's newest run) and `earlier`, the sizes and goals of `counted` (each case's newest complete run;
    a goal's ratio pairs its runs among every run)."""
    # each system's largest completed size as it trains by default: at the global batch of Megatron's largest
    # (every peer's), else at any; ZeRO-Cache's largest at any global batch and with bf16 sums beside it
    done = [r for r in counted if r["ok"]]
    largest_of = lambda sys_, keep: max((r for r in done if r["system"] == sys_ and keep(r)),  # noqa: E731
                                        key=lambda r: (r["layers"], r["gb"]), default=None)
    best_any = {s: b for s in SYSTEMS if (b := largest_of(s, current))}
    a = best_any.get("megatron")
    best = {s: largest_of(s, lambda r: current(r) and a and r["gb"] == a["gb"]) or b for s, b in best_any.items()}
    opt_out = {s: b for s in SYSTEMS if (b := largest_of(s, opt_out_run))}
    order = lambda r: (r["system"], r["layers"], r["gb"])  # noqa: E731
    every = rows + [e for e, _ in earlier]
    text = render(runs=sorted(rows, key=order), earlier=sorted(earlier, key=lambda e: order(e[0])),
                  largest=largest(counted, best, best_any, opt_out),
                  goals=goals(best, best_any, opt_out, every),
                  profiled=sorted((r for r in rows if r["profile"]), key=lambda r: (r["layers"], r["gb"])),
                  f=Figures(cases), label=LABEL, systems=SYSTEMS, llama=llama, least=MEASURED_LEAST)
    return text, best


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
    # a size whose run has fewer than MEASURED_LEAST measured steps is drawn hatched and said so under its bar
    bars = ax1.bar([f"{LABEL[s][:3]}\nbatch {best[s]['gb']}" + ("" if best[s]["headline"] else
                                                                f"\n{best[s]['measured']} measured steps")
                    for s in names], [best[s]["params"] / 1e9 for s in names], color="tab:blue")
    for bar, s in zip(bars, names):
        if not best[s]["headline"]:
            bar.set_hatch("//")
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
    ax2.set_title(f"Throughput at each system's largest size\n(runs of {MEASURED_LEAST} measured steps or more)",
                  fontsize=9)
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="BENCHMARKS.md and benchmarks/peers.png from the result files")
    ap.add_argument("--results", default=str(RESULTS), help="the result files' directory")
    ap.add_argument("--out-dir", default=str(ROOT), help="where BENCHMARKS.md (and benchmarks/peers.png) go")
    ap.add_argument("--no-chart", action="store_true")
    args = ap.parse_args(argv)
    return report(Path(args.results), Path(args.out_dir), with_chart=not args.no_chart)


if __name__ == "__main__":
    sys.exit(main())
