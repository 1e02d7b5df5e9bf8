"""Peer (c) of the side-by-side benchmark: the same GPT, the same data and the same optimizer settings
trained by DeepSpeed ZeRO, one process per GPU, in one of DeepSpeed's CPU-offload configurations:

    zero3_offload      ZeRO-3, parameters and optimizer states offloaded to CPU memory (the default)
    zero3_offload_opt  ZeRO-3, optimizer states offloaded to CPU memory, parameters kept on the GPU
    zero2_offload_opt  ZeRO-2, optimizer states offloaded to CPU memory (ZeRO-Offload)

Host buffers are pinned (DeepSpeed's default); the optimizer is DeepSpeed's CPU AdamW.

    pip install 'angelgpt[bench]'     # DeepSpeed; its CPU Adam op builds on first use (ninja, a C++ compiler)
    python scripts/bench_deepspeed.py --size h200-16b --metrics-file /tmp/m.jsonl train.train_iters=6 \
        model.num_layers=7 train.micro_batch_size=8 train.global_batch_size=32 deepspeed_config=zero2_offload_opt

It takes `angelgpt train`'s config (preset, then KEY=VALUE overrides; ZeRO-Cache keys are ignored;
`deepspeed_config=NAME` picks the configuration; `deepspeed.A.B=VALUE` sets a key of the DeepSpeed
config, for example `deepspeed.zero_optimization.offload_optimizer.pin_memory=false`) and trains what
`angelgpt train` trains: the model shape, batch, FLOP count, the batches of angelgpt's data pipeline
(Megatron's mock dataset by default, through angelgpt.data), the loss (mean over unmasked tokens, the
micro batches averaged), angelgpt's LR schedule (Megatron's OptimizerParamScheduler as
angelgpt.optimizer.schedule builds it: warmup from 0, then decay, stepped once per optimizer step, handed to
deepspeed.initialize), AdamW's betas, eps and weight decay with biases and norms undecayed,
global-norm clipping, bf16 weights with fp32 master weights. It writes the same metrics records (JSON
lines) and log lines, and a `resolved:` line with the DeepSpeed config. The model is a plain PyTorch GPT
of Megatron's GPTModel shapes, layouts and initialisation (learned positions, LayerNorm, biased linears
with the fused QKV weight in Megatron's per-head [q, k, v] order, GELU MLP, tied output layer, SDPA
causal attention, full activation recompute per layer): ZeRO-3 gathers a module's own parameters around
its forward, and this model keeps each weight in the module that uses it, the tied output layer sharing
the embedding's parameter. benchmarks.train runs it with --runner deepspeed; `python -m
benchmarks.deepspeed_peer ...` is the same as `python scripts/bench_deepspeed.py ...`. This is a second
training loop beside angelgpt's on purpose: it is the peer measured against angelgpt, and
tests/unit/test_bench_deepspeed_model.py holds it to angelgpt's model, batches, loss and schedule.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from angelgpt.config import Config, ConfigError, parse
from angelgpt.model.flops import flops_per_iteration
from angelgpt.optimizer import no_weight_decay
from angelgpt.train.metrics import MetricsWriter, gpu_memory_gib, host_memory_gib

# DeepSpeed's CPU-offload configurations: ZeRO stage, where the parameters live, where the optimizer runs
CONFIGS = {
    "zero3_offload": {"stage": 3, "offload_param": True, "offload_optimizer": True},
    "zero3_offload_opt": {"stage": 3, "offload_param": False, "offload_optimizer": True},
    "zero2_offload_opt": {"stage": 2, "offload_param": False, "offload_optimizer": True},
}
DEFAULT_CONFIG = "zero3_offload"
# torch's pinned-memory allocator rounds each allocation up to a power of two (a 24 GB fp32 partition
# takes 32 GiB); above this size it allocates exactly, where this torch has the setting
PINNED_EXACT_ABOVE_MB = 64


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
    """Pre-norm transformer layer: x + attn(ln(x)), then x + mlp(ln(x)); x is [b, s, h]. The fused QKV
    weight's rows are Megatron's: per head its query, key and value rows ([heads, 3, d] flattened)."""

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
        qkv = self.qkv(self.ln1(x)).view(b, s, self.heads, 3, self.head_dim)  # [b, s, heads, 3, d]
        q, k, v = qkv.permute(3, 0, 2, 1, 4)  # each [b, heads, s, d]
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
        if m.untie_embeddings_and_output_weights:
            self.lm_head = Linear(m.hidden_size, vocab, std, bias=False)
        else:
            self.lm_head = nn.Linear(m.hidden_size, vocab, bias=False)
            self.lm_head.weight = self.wte.weight  # tied, as Megatron's GPTModel ties them by default
        self.recompute = m.recompute == "full"

    def forward(self, tokens, labels, position_ids=None, loss_mask=None):
        """Mean next-token cross entropy over the tokens loss_mask keeps (all when None), as angelgpt's
        loss_func takes it; tokens, labels, position_ids and loss_mask are [b, s]."""
        if position_ids is None:
            position_ids = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
        x = self.wte(tokens) + self.wpe(position_ids)  # [b, s, h]
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=True) if self.recompute and self.training else block(x)
        logits = self.lm_head(self.ln_f(x))  # [b, s, vocab]
        losses = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="none")  # [b * s]
        if loss_mask is None:
            return losses.mean()
        mask = loss_mask.reshape(-1).float()
        return (losses * mask).sum() / mask.sum().clamp(min=1.0)


def unsupported(cfg: Config):
    """What of cfg this model does not build (None when it builds all of it)."""
    m = cfg.model
    if m.position_embedding_type != "learned_absolute":
        return f"model.position_embedding_type '{m.position_embedding_type}' (this model has learned positions)"
    if m.num_query_groups not in (None, m.num_attention_heads):
        return "model.num_query_groups below the number of heads (this model has multi-head attention)"
    if m.normalization != "LayerNorm" or m.norm_epsilon != 1e-5:
        return f"model.normalization '{m.normalization}', eps {m.norm_epsilon} (this model has LayerNorm, eps 1e-5)"
    if m.swiglu or not m.add_bias_linear:
        return "model.swiglu or no linear biases (this model has a GELU MLP and biased linears)"
    if m.hidden_dropout or m.attention_dropout:
        return "dropout (this model has none)"
    if cfg.parallel.tensor_model_parallel_size * cfg.parallel.pipeline_model_parallel_size != 1:
        return "tensor or pipeline parallelism (DeepSpeed ZeRO here is data parallel only)"
    return None


def param_groups(model: nn.Module, weight_decay: float) -> list:
    """angelgpt's AdamW groups: biases and 1-D parameters (norms) take no weight decay, as in Megatron;
    wd_mult is what Megatron's scheduler reads when it sets each group's decay."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():  # a tied weight once
        shape = getattr(p, "ds_shape", p.shape)  # ZeRO-3 leaves a partitioned parameter an empty 1-D tensor
        (no_decay if no_weight_decay(name, torch.empty(shape, device="meta")) else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay, "wd_mult": 1.0},
            {"params": no_decay, "weight_decay": 0.0, "wd_mult": 0.0}]


class MegatronLR:
    """angelgpt's LR schedule as a client scheduler for deepspeed.initialize: Megatron's
    OptimizerParamScheduler exactly as angelgpt.optimizer.schedule.build_scheduler builds it (the LR of
    step 1 is the warmup's start, 0), stepped by DeepSpeed's engine once after each optimizer step."""

    def __init__(self, optimizer, cfg: Config):
        from angelgpt.optimizer.schedule import build_scheduler

        self.optimizer = optimizer
        self.inner = build_scheduler(optimizer, cfg)

    def step(self, *_, **__) -> None:
        self.inner.step(increment=1)

    def get_last_lr(self) -> list:
        return [g["lr"] for g in self.optimizer.param_groups]

    def state_dict(self) -> dict:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.inner.load_state_dict(state)


def ds_config(cfg: Config, world: int, on_gpu: bool, name: str = DEFAULT_CONFIG) -> dict:
    """The DeepSpeed config of configuration `name` (CONFIGS): host buffers pinned on GPU, DeepSpeed's
    defaults for the buckets and prefetch, bf16 with fp32 master weights, AdamW and clipping from
    angelgpt's config (the LR is the schedule's, MegatronLR)."""
    o, t, c = cfg.optim, cfg.train, CONFIGS[name]
    zero = {"stage": c["stage"], "overlap_comm": on_gpu, "contiguous_gradients": True}
    if c["offload_param"]:
        zero["offload_param"] = {"device": "cpu", "pin_memory": on_gpu}
    if c["offload_optimizer"]:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": on_gpu}
    return {
        "train_batch_size": t.global_batch_size,
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": t.global_batch_size // (t.micro_batch_size * world),
        "gradient_clipping": o.clip_grad,
        "bf16": {"enabled": on_gpu},
        "optimizer": {"type": "AdamW", "params": {"lr": o.lr, "betas": [o.adam_beta1, o.adam_beta2],
                                                  "eps": o.adam_eps, "weight_decay": o.weight_decay}},
        "zero_optimization": zero,
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


def train_batches(cfg: Config, rank: int, world: int, device):
    """This rank's micro batches, the ones `angelgpt train` reads: angelgpt.data's datasets (Megatron's
    mock or indexed datasets, the sizes the worker asks for) in its sample order."""
    from angelgpt.data.dataset import build_datasets, micro_batches
    from angelgpt.data.tokenizer import MockTokenizer, load_tokenizer

    tokenizer = MockTokenizer(cfg.model.vocab_size) if cfg.data.is_mock else load_tokenizer(cfg.data.tokenizer)
    gb = cfg.train.global_batch_size
    valid_samples = cfg.train.eval_iters * gb if cfg.train.eval_interval else 0
    train, _ = build_datasets(cfg, tokenizer, cfg.train.train_iters * gb, valid_samples)
    return micro_batches(train, 0, cfg.train.micro_batch_size, rank, world, device)


def exact_pinned_sizes() -> str:
    """Asks torch's pinned allocator for exact sizes above PINNED_EXACT_ABOVE_MB; says what happened."""
    setting = f"pinned_max_round_threshold_mb:{PINNED_EXACT_ABOVE_MB}"
    try:
        torch.cuda.memory._set_allocator_settings(setting)
    except Exception as exc:  # a torch without the setting refuses the key
        return f"pinned sizes rounded to powers of two (this torch refused {setting}: {str(exc).splitlines()[0][:120]})"
    return f"pinned sizes exact above {PINNED_EXACT_ABOVE_MB} MiB ({setting})"


def progress(rank: int, what: str) -> None:
    if rank == 0:
        print(f"bench_deepspeed: {what} (host peak {host_memory_gib():.1f} GiB)", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default=None)
    ap.add_argument("--metrics-file", default=None)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    names = [o.partition("=")[2] for o in args.overrides if o.startswith("deepspeed_config=")]
    name = names[-1] if names else DEFAULT_CONFIG
    if name not in CONFIGS:
        print(f"bench_deepspeed: deepspeed_config is one of {', '.join(CONFIGS)}, got '{name}'", file=sys.stderr)
        return 2
    ds_keys = [o for o in args.overrides if o.startswith("deepspeed.")]
    if any("=" not in o or not o.partition("=")[0][len("deepspeed."):] for o in ds_keys):
        print("bench_deepspeed: a DeepSpeed override is deepspeed.KEY.PATH=VALUE", file=sys.stderr)
        return 2
    rest = [o for o in args.overrides if o not in ds_keys and not o.startswith("deepspeed_config=")]
    try:
        cfg = parse(args.size, None, rest)
    except ConfigError as exc:
        print(f"bench_deepspeed: {exc}", file=sys.stderr)
        return 2
    problem = unsupported(cfg)
    if problem:
        print(f"bench_deepspeed: this peer does not build {problem}", file=sys.stderr)
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
    config = ds_config(cfg, world, on_gpu, name)
    set_ds_keys(config, ds_keys)
    try:  # DeepSpeed's own validation, before any large allocation
        DeepSpeedConfig(config)
    except Exception as exc:  # pydantic's ValidationError or DeepSpeed's assertions on the values
        problem = " ".join(line.strip() for line in str(exc).splitlines()[:3])
        print(f"bench_deepspeed: the DeepSpeed config is refused: {problem}", file=sys.stderr)
        return 2
    zero = config["zero_optimization"]
    pinned = on_gpu and any(zero.get(k, {}).get("pin_memory") for k in ("offload_param", "offload_optimizer"))
    pinning = exact_pinned_sizes() if pinned else "no pinned host buffers"
    if rank == 0:  # benchmarks.train keeps `resolved:` lines in the result file
        print(f"resolved: DeepSpeed {deepspeed.__version__} {name}; {pinning}; config {json.dumps(config)}",
              flush=True)
    progress(rank, f"DeepSpeed {name}: building the model")
    torch.manual_seed(cfg.train.seed)
    dtype = torch.bfloat16 if on_gpu else torch.float32
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    if zero["stage"] == 3:  # partitioned as it is built, on the host where parameters are offloaded
        offload_param = zero.get("offload_param", {}).get("device", "none") not in (None, "none")
        building = deepspeed.zero.Init(config_dict_or_path=config, dtype=dtype,
                                       remote_device="cpu" if offload_param else None,
                                       pin_memory=offload_param and zero["offload_param"].get("pin_memory", False))
    else:  # ZeRO-2 keeps the bf16 weights on the GPU: drawn there in bf16, as Megatron draws them
        building = device
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with building:
            model = GPT(cfg)
    finally:
        torch.set_default_dtype(previous)
    progress(rank, "model built; creating the engine and its CPU Adam")
    engine, *_ = deepspeed.initialize(model=model, model_parameters=param_groups(model, cfg.optim.weight_decay),
                                      config=config, lr_scheduler=lambda opt: MegatronLR(opt, cfg))
    progress(rank, "engine ready; building the data and training")
    device = engine.device
    m, t = cfg.model, cfg.train
    writer = MetricsWriter(rank == 0, args.metrics_file, None)
    flops, tokens_per_iter = flops_per_iteration(cfg), t.global_batch_size * m.seq_length
    batches = train_batches(cfg, rank, world, device)
    for iteration in range(1, t.train_iters + 1):
        start = time.perf_counter()
        losses = []
        for _ in range(engine.gradient_accumulation_steps()):
            batch = next(batches)  # each [b, s]
            loss = engine(batch["tokens"], batch["labels"], batch["position_ids"], batch["loss_mask"])
            losses.append(loss.detach().clone())
            engine.backward(loss)  # the loss over the micro batches' count: their gradients averaged
            engine.step()  # DeepSpeed clips, updates and steps the LR at the last micro batch of the step
        if on_gpu:
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        norm = engine.get_global_grad_norm()  # before clipping, as angelgpt logs it
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
