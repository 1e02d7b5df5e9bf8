"""The Llama family's part of BENCHMARKS.md (benchmarks/peers.py --family llama: the llama3-8b preset's
layer at sequence 4096, global batch 32, llama-SYSTEM-Llayers-... result files): each case's newest run,
each system's largest size that completed 3 measured steps, and the family's goals: whether each system
trains Llama-3-8B itself (32 layers), ZeRO-Cache's speed at Megatron's largest size against Megatron's
(goal 1.0x) and at its own largest against Megatron's at its largest (goal 0.75x), each ratio from two
runs of one device call. Model TFLOP/s count the architecture's FLOPs as Megatron's
num_floating_point_operations does (SwiGLU's three matrices, grouped-query attention's smaller K/V,
the untied output layer): angelgpt/model/flops.py."""

from __future__ import annotations

SYSTEMS = ("megatron", "zero_cache")
PRESET, SHAPE, LLAMA_3_8B = "llama3-8b", ["model.seq_length=4096"], 32


def llama_family(cases) -> dict:
    """{rows, largest, goals, eight_b} for the template from `cases` (benchmarks.results.runs_by_case)."""
    from angelgpt.config import parse
    from angelgpt.model.flops import num_params
    from benchmarks.report import goal, pick, row

    rows = []
    for case in sorted(c for c in cases if c.startswith("llama-")):
        r = row(*cases[case][-1])
        r["params"] = num_params(parse(PRESET, overrides=[*SHAPE, f"model.num_layers={r['layers']}"]))
        r["measured"] = max(0, r["steps"] - int(r["raw"].get("warmup_iters") or 0))
        r["ok"] = r["ok"] and r["measured"] >= 3
        rows.append(r)
    done = {s: [r for r in rows if r["system"] == s and r["ok"] and r["tflops"]] for s in SYSTEMS}
    largest = {s: max(done[s], key=lambda r: r["layers"]) for s in SYSTEMS if done[s]}
    goals = []
    a, d = largest.get("megatron"), largest.get("zero_cache")
    for kind, target, xs in (("speed_at_megatrons_largest", 1.0,
                              [r for r in done["zero_cache"] if a and r["layers"] == a["layers"]]),
                             ("speed_at_own_largest", 0.75, [d] if d else [])):
        x, y = pick(xs, [a], lambda r: r["tflops"]) if xs and a else (None, None)
        goals.append(goal(kind, target, x, y, a=a, d=d))
    eight_b = {s: next((r for r in rows if r["system"] == s and r["layers"] == LLAMA_3_8B), None) for s in SYSTEMS}
    return dict(rows=sorted(rows, key=lambda r: (r["system"], r["layers"])), largest=largest, goals=goals,
                eight_b=eight_b)
