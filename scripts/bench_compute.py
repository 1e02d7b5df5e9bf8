"""GPU compute calibration: forward and backward of one tensor-parallel rank's GPT, timed alone.

    python scripts/bench_compute.py --name compute-grid --size 55 --size 28 --tp 1,2,4,8 \
        --micro-batches 1,2,4,8,16,32

For every preset shape, tensor-parallel size and micro batch asked for, this plays rank 0 of a
tensor-parallel group under torch's fake process group (angelgpt.parallel, as a rehearsal does: the
rank's real shard, sequence parallel where the preset has it, collectives that move no data) and times
one micro batch's forward and backward with full recompute, as the presets run, twice: with one
transformer layer and with three. The difference is two layers' time; what the one-layer model takes
beyond one layer is the rest (embedding, logits, loss). No optimizer and no gradient accumulation: the
time of the GPU's kernels alone, what the planner's compute time (planner.plan) stands for.

One result file under --out (default benchmarks/results/, never overwritten: -runN is appended;
benchmarks.results writes it) with the command, commit, machine and, per point, the median times after
warm-up in seconds and the hardware FLOPs each ran (angelgpt.model.flops's counts), so that a fit can be
redone from the file.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # angelgpt and the benchmarks package of this checkout


def _model(size: str, tp: int, layers: int):
    import torch
    from megatron.core import tensor_parallel
    from megatron.core.transformer.module import Float16Module

    from angelgpt.config import parse
    from angelgpt.model.gpt import build_gpt

    cfg = parse(size, None, [f"model.num_layers={layers}", f"parallel.tensor_model_parallel_size={tp}",
                               "parallel.pipeline_model_parallel_size=1",
                               f"parallel.sequence_parallel={'true' if tp > 1 else 'false'}",
                               "model.recompute=full", "model.activation_offload=none"])

    torch.manual_seed(0)
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    model = build_gpt(cfg, on_gpu=True)
    return cfg, Float16Module(model.config, model)  # bf16 weights and inputs, as training runs it


def _time(model, cfg, micro_batch: int, iters: int, warmup: int) -> float:
    """Median seconds of one micro batch's forward and backward (loss: the mean over tokens)."""
    import torch

    s = cfg.model.seq_length
    dev = torch.device("cuda", 0)
    tokens = torch.randint(0, cfg.model.vocab_size, (micro_batch, s), device=dev)
    labels = torch.randint(0, cfg.model.vocab_size, (micro_batch, s), device=dev)
    positions = torch.arange(s, device=dev).unsqueeze(0).expand(micro_batch, s)
    times = []
    for i in range(warmup + iters):
        for p in model.parameters():
            p.grad = None
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        model(tokens, positions, None, labels=labels).float().mean().backward()
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(size: str, tp: int, micro_batches, iters: int, warmup: int) -> list:
    import torch

    from angelgpt import parallel
    from angelgpt.model.flops import head_forward_flops_per_token, layer_forward_flops_per_token

    with parallel.Rehearsal(rank=0, world_size=tp).started(tp, 1, on_gpu=True):
        timed = {}
        for layers in (1, 3):
            cfg, model = _model(size, tp, layers)
            for mb in micro_batches:
                try:
                    timed[layers, mb] = _time(model, cfg, mb, iters, warmup)
                except torch.OutOfMemoryError:
                    timed[layers, mb] = None
                torch.cuda.empty_cache()
            del model
            torch.cuda.empty_cache()
    out = []
    for mb in micro_batches:
        one, three = timed[1, mb], timed[3, mb]
        tokens = mb * cfg.model.seq_length
        point = {"size": size, "tp": tp, "micro_batch": mb, "tokens": tokens,
                 "hidden": cfg.model.hidden_size, "heads": cfg.model.num_attention_heads,
                 "one_layer_s": one, "three_layers_s": three}
        if one is not None and three is not None:
            layer_s = (three - one) / 2
            # a recomputed layer's hardware FLOPs: forward, forward again, backward (2 forwards)
            layer_flops = 4 * tokens * layer_forward_flops_per_token(cfg) / tp
            head_flops = 3 * tokens * head_forward_flops_per_token(cfg) / tp
            point.update(layer_s=layer_s, rest_s=one - layer_s, layer_flops=layer_flops, head_flops=head_flops,
                         layer_tflops=round(layer_flops / layer_s / 1e12, 1),
                         rest_tflops=round(head_flops / (one - layer_s) / 1e12, 1))
        out.append(point)
        print(json.dumps(point), flush=True)
    return out


def _positive_ints(text: str) -> list:
    """'1,2,4' -> [1, 2, 4]; anything else is refused by argparse in one line (exit 2)."""
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive whole numbers separated by commas, got {text!r}")
    return values


def main() -> int:
    from benchmarks.results import RESULTS, invocation, stamp, write_result

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--name", required=True)
    ap.add_argument("--size", action="append", required=True, help="a preset whose shape is timed (repeatable)")
    ap.add_argument("--tp", type=_positive_ints, default="1,2,4,8", help="tensor-parallel sizes, comma separated")
    ap.add_argument("--micro-batches", type=_positive_ints, default="1,2,4,8,16,32")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--out", default=str(RESULTS))
    a = ap.parse_args()
    import torch

    from angelgpt.config import ConfigError, parse

    for size in a.size:
        try:
            parse(size, None, [])
        except ConfigError as exc:
            ap.error(f"--size {size}: {exc}")
    if not torch.cuda.is_available():
        ap.error("times the GPU's kernels: needs a CUDA GPU")
    points = []
    started = time.time()
    for size in a.size:
        for tp in a.tp:
            points += measure(size, tp, a.micro_batches, a.iters, a.warmup)
    result = stamp(a.name, invocation())
    result.update(wall_s=round(time.time() - started, 1), points=points,
                  what="one micro batch's forward and backward with full recompute, no optimizer; "
                       "layer_s = (three_layers_s - one_layer_s) / 2")
    print(f"wrote {write_result(a.out, result, indent=1)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
