"""angelgpt's own GPT in one process, its weights read from any checkpoint layout (for generate and eval).

    from angelgpt.export.checkpoint_reader import CheckpointReader
    from angelgpt.export.local_model import load_local_model
    reader = CheckpointReader.open("runs/ck")
    with load_local_model(reader, device="cpu") as (model, cfg):
        logits = model(tokens, position_ids, None)           # [batch, seq, padded vocab], fp32

The model is ``model/gpt.py``'s build_gpt at tensor and pipeline parallel size 1, fp32, Megatron's
local layer spec (SDPA core attention), built on CPU without initialisation and moved to CUDA with
``device="cuda"``. Megatron needs its parallel_state, so a single-rank gloo group (an in-memory store,
no port) and Megatron's TP/PP/DP groups of one are made, as ``angelgpt/parallel`` does for a torchrun
worker, and destroyed on leaving.

Weights come through the streaming reader: each parameter's Megatron sharded key (what the model's
``sharded_state_dict()`` names it, its layer the global layer index) is read straight into it, so a
checkpoint written at any TP/PP/DP layout, by either optimizer and either saver, loads here; the run's
padded vocabulary is kept (``make_vocab_size_divisible_by`` is set to it).
"""

from __future__ import annotations

import tempfile
from contextlib import contextmanager
from dataclasses import replace
from typing import List, Optional

import torch

from angelgpt.config import ConfigError


def run_config(reader, overrides: Optional[List[str]] = None, device: str = "cpu"):
    """The run's Config (the checkpoint manifest's) for one process: TP 1, PP 1, the stored padded
    vocabulary, no recompute, local layers, no save or load; KEY=VALUE overrides on top."""
    import yaml

    from angelgpt.config import parse

    raw = {k: dict(v) if isinstance(v, dict) else v for k, v in reader.config.items()}
    padded = int(reader.shape("embedding.word_embeddings.weight")[0])
    raw["model"].update(make_vocab_size_divisible_by=padded, recompute="none", recompute_num_layers=None,
                        activation_offload="none", transformer_impl="local")
    raw["parallel"].update(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    if "sequence_parallel" in raw["parallel"]:
        raw["parallel"]["sequence_parallel"] = False
    raw["checkpoint"] = {"save": None, "load": None}
    raw["logging"] = {"log_interval": 1, "tensorboard_dir": None, "metrics_file": None}
    raw.setdefault("train", {})["device"] = device
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", prefix="angelgpt-run-") as fh:
        yaml.safe_dump(raw, fh)
        fh.flush()
        cfg = parse(None, fh.name, list(overrides or []))
    if not cfg.optim.spec.runs_on_cpu:  # no optimizer is built here: one that needs CUDA is not refused on CPU
        cfg = replace(cfg, optim=replace(cfg.optim, optimizer="megatron"))
    if cfg.padded_vocab_size() != padded:
        raise ConfigError(f"model.vocab_size {cfg.model.vocab_size} does not fit the checkpoint's vocabulary "
                          f"of {padded}")
    from angelgpt.config import to_dict
    from angelgpt.train.checkpoint_check import model_mismatch

    problem = model_mismatch(reader.config, to_dict(cfg))  # a model.* override that reshapes a parameter
    if problem:
        raise ConfigError(f"--load {reader.path} holds another model: {problem}")
    cfg.check_device(device == "cuda")
    return cfg


@contextmanager
def single_process():
    """A gloo group of one rank and Megatron's parallel_state at TP 1 and PP 1, for the duration."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    made = not dist.is_initialized()
    if made:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()
        if made:
            dist.destroy_process_group()


def _sharded_tensors(tree):
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    if isinstance(tree, ShardedTensorFactory):  # SwiGLU's linear_fc1: its gate and up halves, each a region
        yield from _sharded_tensors(tree.build())
    elif isinstance(tree, dict):
        for v in tree.values():
            yield from _sharded_tensors(v)
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            yield from _sharded_tensors(v)
    elif isinstance(tree, ShardedTensor):
        yield tree


def load_weights(model, reader) -> int:
    """Reads every parameter of the (TP 1, PP 1) model from the checkpoint; returns how many tensors."""
    from angelgpt.data.tokenizer import progress_bar

    loaded = 0
    tensors = list(_sharded_tensors(model.sharded_state_dict()))
    for sh in progress_bar(None, iterable=tensors, desc=f"loading iteration {reader.iteration}", unit="tensor"):
        n = sh.prepend_axis_num
        if n > 1:
            raise ConfigError(f"checkpoint key {sh.key} has {n} stacked axes; only the layer axis is read")
        layer = sh.global_offset[0] if n else None
        if not reader.has(sh.key, layer):
            where = f" (layer {layer})" if layer is not None else ""
            raise ConfigError(f"checkpoint {reader.path} has no {sh.key}{where}: it was not written for this "
                              f"model's architecture")
        stored = reader.shape(sh.key, layer)
        if tuple(stored) != tuple(sh.global_shape[n:]):
            raise ConfigError(f"checkpoint {reader.path}: {sh.key} is {tuple(stored)}, the model's is "
                              f"{tuple(sh.global_shape[n:])}")
        # the model's tensor is the stored one whole, or (SwiGLU's gate or up half) a region of it
        region = torch.empty(sh.data.shape, dtype=reader.dtype(sh.key, layer))
        reader.read_into(sh.key, region, layer, tuple(sh.global_offset[n:]))
        with torch.no_grad():
            sh.data.copy_(region)
        loaded += 1
    return loaded


@contextmanager
def load_local_model(reader, device: str = "cpu", overrides: Optional[List[str]] = None):
    """Yields (model in eval mode on device, its Config) inside a single-process parallel state."""
    from angelgpt.model.gpt import build_gpt

    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda but no CUDA GPU is visible")
    cfg = run_config(reader, overrides, device)
    with single_process():
        model = build_gpt(cfg, on_gpu=False, perform_initialization=False)  # fp32, on CPU
        load_weights(model, reader)
        if device == "cuda":
            model.cuda()
        model.eval()
        yield model, cfg
