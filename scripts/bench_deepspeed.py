"""Peer (c) of the side-by-side benchmark: the same GPT trained by DeepSpeed ZeRO-3 with its parameters
and optimizer states offloaded to CPU memory (pinned by default; DeepSpeed's CPU Adam), one process per GPU.

    pip install 'angelgpt[bench]'     # DeepSpeed; its CPU Adam op builds on first use (ninja, a C++ compiler)
    python scripts/bench_deepspeed.py --size h200-16b --metrics-file /tmp/m.jsonl train.train_iters=6 \
        model.num_layers=7 train.micro_batch_size=4 train.global_batch_size=32

It takes `angelgpt train`'s config (preset, then KEY=VALUE overrides; optimizer and ZeRO-Cache keys are
ignored; `deepspeed.A.B=VALUE` sets a key of the DeepSpeed config, for example
`deepspeed.zero_optimization.offload_param.pin_memory=false`) so that the model shape, batch, AdamW
hyper-parameters, clipping and FLOP count are the ones the other systems run, and it writes the same
metrics records (JSON lines) and log lines. The model is a plain PyTorch GPT of Megatron's GPTModel
shapes and initialisation (learned positions, LayerNorm, biased linears, GELU MLP, tied output layer,
SDPA causal attention, full activation recompute per layer): ZeRO-3 gathers a module's own parameters
around its forward, and this model keeps each weight in the module that uses it, the tied output
layer sharing the embedding's parameter. bench_train.py runs it with --runner deepspeed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from angelgpt.config import Config, ConfigError, resolve  # noqa: E402
from angelgpt.model.flops import flops_per_iteration  # noqa: E402
from angelgpt.train.metrics import MetricsWriter, gpu_memory_gib, host_memory_gib  # noqa: E402


class Linear(nn.Linear):
    """nn.Linear initialised as Megatron initialises it: normal(0, std) weight, zero bias. The init runs
    inside __init__, where ZeRO-3's zero.Init still holds the whole tensor (it partitions right after)."""

    def __init__(self, n_in: int, n_out: int, std: float, bias: bool = True):
        super().__init__(n_in, n_out, bias=bias)
        nn.init.normal_(self.weight, std=std)
        if bias:
            nn.init.zeros_(self.bias)


class Embedding(nn.Embedding):
    def __init__(self, n: int, dim: int, std: float):
        super().__init__(n, dim)
        nn.init.normal_(self.weight, std=std)


class Block(nn.Module):
    """Pre-norm transformer layer: x + attn(ln(x)), then x + mlp(ln(x)); x is [b, s, h]."""

    def __init__(self, cfg: Config):
        super().__init__()
        m = cfg.model
        h, q = m.hidden_size, m.num_attention_heads * m.kv_channels
        self.heads, self.head_dim = m.num_attention_heads, m.kv_channels
        self.ln1, self.ln2 = nn.LayerNorm(h), nn.LayerNorm(h)
        std, out_std = m.init_method_std, m.init_method_std / (2 * m.num_layers) ** 0.5  # Megatron's scaled init
        self.qkv, self.proj = Linear(h, 3 * q, std), Linear(q, h, out_std)
        self.fc1, self.fc2 = Linear(h, m.ffn_hidden_size, std), Linear(m.ffn_hidden_size, h, out_std)

    def forward(self, x):
        b, s, _ = x.shape
        qkv = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, self.head_dim)  # [b, s, 3, heads, d]
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # each [b, heads, s, d]
        ctx = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(ctx.transpose(1, 2).reshape(b, s, -1))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        m = cfg.model
        vocab = cfg.padded_vocab_size()
        std = m.init_method_std
        self.wte, self.wpe = Embedding(vocab, m.hidden_size, std), Embedding(m.seq_length, m.hidden_size, std)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(m.num_layers))
        self.ln_f = nn.LayerNorm(m.hidden_size)
        self.lm_head = nn.Linear(m.hidden_size, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied, as Megatron's GPTModel ties them by default
        self.recompute = m.recompute == "full"

    def forward(self, tokens, labels):
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.wte(tokens) + self.wpe(positions)  # [b, s, h]
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=True) if self.recompute and self.training else block(x)
        logits = self.lm_head(self.ln_f(x))  # [b, s, vocab]
        return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())


def ds_config(cfg: Config, world: int, on_gpu: bool) -> dict:
    """ZeRO-3 with parameters and optimizer states offloaded to (pinned) CPU memory; DeepSpeed's defaults
    for the buckets and prefetch, bf16, AdamW and clipping from angelgpt's config."""
    o, t = cfg.optim, cfg.train
    return {
        "train_batch_size": t.global_batch_size,
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": t.global_batch_size // (t.micro_batch_size * world),
        "gradient_clipping": o.clip_grad,
        "bf16": {"enabled": on_gpu},
        "optimizer": {"type": "AdamW", "params": {"lr": o.lr, "betas": [o.adam_beta1, o.adam_beta2],
                                                  "eps": o.adam_eps, "weight_decay": o.weight_decay}},
        "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "pin_memory": on_gpu},
                              "offload_optimizer": {"device": "cpu", "pin_memory": on_gpu},
                              "overlap_comm": on_gpu, "contiguous_gradients": True},
        "steps_per_print": 10 ** 9,
    }


def set_ds_keys(config: dict, overrides) -> None:
    """Applies `deepspeed.A.B=VALUE` overrides (VALUE read as JSON where it parses, else as a string)."""
    for item in overrides:
        path, _, text = item[len("deepspeed."):].partition("=")
        *parents, last = path.split(".")
        node = config
        for key in parents:
            node = node.setdefault(key, {})
        try:
            node[last] = json.loads(text)
        except json.JSONDecodeError:
            node[last] = text


def progress(rank: int, what: str) -> None:
    if rank == 0:
        print(f"bench_deepspeed: {what} (host peak {host_memory_gib():.1f} GiB)", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default=None)
    ap.add_argument("--metrics-file", default=None)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    ds_keys = [o for o in args.overrides if o.startswith("deepspeed.")]
    if any("=" not in o or not o.partition("=")[0][len("deepspeed."):] for o in ds_keys):
        print("bench_deepspeed: a DeepSpeed override is deepspeed.KEY.PATH=VALUE", file=sys.stderr)
        return 2
    try:
        cfg = resolve(args.size, None, [o for o in args.overrides if o not in ds_keys])
    except ConfigError as exc:
        print(f"bench_deepspeed: {exc}", file=sys.stderr)
        return 2
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"),
                       ("MASTER_PORT", "29517")):
        os.environ.setdefault(key, value)
    try:
        import deepspeed
        from deepspeed.runtime.config import DeepSpeedConfig
    except ImportError:
        print("bench_deepspeed: DeepSpeed is not installed (pip install 'angelgpt[bench]')", file=sys.stderr)
        return 2

    on_gpu = torch.cuda.is_available()
    if on_gpu:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    deepspeed.init_distributed()
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    config = ds_config(cfg, world, on_gpu)
    set_ds_keys(config, ds_keys)
    try:  # DeepSpeed's own validation, before any large allocation
        DeepSpeedConfig(config)
    except Exception as exc:  # pydantic's ValidationError or DeepSpeed's assertions on the values
        problem = " ".join(line.strip() for line in str(exc).splitlines()[:3])
        print(f"bench_deepspeed: the DeepSpeed config is refused: {problem}", file=sys.stderr)
        return 2
    progress(rank, f"ZeRO-3 config {json.dumps(config['zero_optimization'])}; building the model")
    torch.manual_seed(cfg.train.seed)
    dtype = torch.bfloat16 if on_gpu else torch.float32
    with deepspeed.zero.Init(config_dict_or_path=config, remote_device="cpu", pin_memory=on_gpu, dtype=dtype):
        model = GPT(cfg)
    progress(rank, "model built and partitioned; creating the engine and its CPU Adam")
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    progress(rank, "engine ready; training")
    device = engine.device
    m, t = cfg.model, cfg.train
    writer = MetricsWriter(rank == 0, args.metrics_file, None)
    flops, tokens_per_iter = flops_per_iteration(cfg), t.global_batch_size * m.seq_length
    vocab = cfg.padded_vocab_size()
    generator = torch.Generator().manual_seed(cfg.train.seed + rank)
    for iteration in range(1, t.train_iters + 1):
        start = time.perf_counter()
        losses = []
        for _ in range(engine.gradient_accumulation_steps()):
            tokens = torch.randint(0, cfg.model.vocab_size, (t.micro_batch_size, m.seq_length + 1),
                                   generator=generator).to(device)  # mock data: [b, s + 1]
            loss = engine(tokens[:, :-1], tokens[:, 1:])
            engine.backward(loss)
            engine.step()  # DeepSpeed updates at the last micro batch of the global batch
            losses.append(loss.detach())
        if on_gpu:
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        norm = engine.get_global_grad_norm()
        writer.log({"iteration": iteration, "lm_loss": torch.stack(losses).float().mean().item(), "val_loss": None,
                    "lr": engine.get_lr()[0], "grad_norm": float(norm) if norm is not None else float("nan"),
                    "elapsed_ms": elapsed * 1000.0, "tokens_per_s": tokens_per_iter / elapsed,
                    "tflops_per_gpu": flops / elapsed / world / 1e12, "mem_gpu_gib": gpu_memory_gib(),
                    "mem_host_gib": host_memory_gib(), "consumed_samples": iteration * t.global_batch_size},
                   t.train_iters, iteration * t.global_batch_size, engine.skipped_steps)
    writer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
