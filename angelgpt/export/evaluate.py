"""`angelgpt eval`: mean loss and perplexity of a checkpoint on the validation split, without training.

    angelgpt eval --load runs/ck                               # the run's data, its eval_iters batches
    angelgpt eval --load runs/ck --iters 20 --json
    angelgpt eval --load runs/ck data.paths=data/other_text_document data.split=0,100,0

One process, angelgpt's GPT at TP 1 (local_model.py) whatever layout wrote the checkpoint. The data is
the run's config (the checkpoint manifest's) with KEY=VALUE overrides on top, built as training builds
it (``data/dataset.py`` build_datasets, asking for train_iters x global batch training samples and
iters x global batch validation samples) and read in its ``micro_batches`` order from validation
sample 0. The loss is what training's evaluation reports: each micro batch's mean next-token loss over
its loss-masked tokens, averaged over the global batch's micro batches, then over the iterations.
Without --iters, and without overrides that change the data or the batch sizes, these are the batches
the run's own validation (train.eval_interval) used, so the loss is the one it logged at that
iteration. --iters other than the run's train.eval_iters asks Megatron's builder for another number of
validation samples, which can change its shuffle: the batches differ.

Prints ``loss L perplexity P iteration N tokens T``; --json prints {"loss", "perplexity", "iteration",
"tokens", "iters", "micro_batch_size", "global_batch_size"}.
"""

from __future__ import annotations

import json
import logging
import math
from typing import List, Optional

import torch

from angelgpt.config import ConfigError


@torch.no_grad()
def evaluate(load: str, overrides: Optional[List[str]] = None, iters: Optional[int] = None,
             iteration: Optional[int] = None, device: str = "cpu") -> dict:
    from angelgpt.data.dataset import build_datasets, micro_batches
    from angelgpt.data.tokenizer import MockTokenizer, load_tokenizer
    from angelgpt.export.checkpoint_reader import CheckpointReader
    from angelgpt.export.local_model import load_local_model, run_config
    from angelgpt.train.step import loss_func

    if device not in ("cpu", "cuda"):
        raise ConfigError(f"--device must be 'cpu' or 'cuda', got '{device}'")
    if iters is not None and iters < 1:
        raise ConfigError(f"--iters must be >= 1, got {iters}")
    logging.getLogger("megatron.core.datasets").setLevel(logging.ERROR)
    reader = CheckpointReader.open(load, iteration)
    cfg = run_config(reader, overrides, device)
    cfg.data_parallel_size(1)  # checks the batch sizes
    cfg.data.check_files()
    tokenizer = MockTokenizer(cfg.model.vocab_size) if cfg.data.is_mock else load_tokenizer(cfg.data.tokenizer)
    with load_local_model(reader, device, overrides) as (model, cfg):
        n_iters = iters or cfg.train.eval_iters
        gb, mbs = cfg.train.global_batch_size, cfg.train.micro_batch_size
        _, valid = build_datasets(cfg, tokenizer, cfg.train.train_iters * gb, n_iters * gb)
        if not valid:
            raise ConfigError(f"data.split {cfg.data.split} leaves no validation samples")
        device_t = next(model.parameters()).device
        batches = micro_batches(valid, 0, mbs, 0, 1, device_t)
        per_iter, tokens = [], 0
        for _ in range(n_iters):
            losses = []
            for _ in range(gb // mbs):
                batch = next(batches)
                output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
                loss, _ = loss_func(batch["loss_mask"], output)
                losses.append(loss.item())
                tokens += int(batch["loss_mask"].sum().item())
            per_iter.append(sum(losses) / len(losses))
    loss = sum(per_iter) / len(per_iter)
    return {"loss": loss, "perplexity": math.exp(loss) if loss < 700 else float("inf"),
            "iteration": reader.iteration, "tokens": tokens, "iters": n_iters, "micro_batch_size": mbs,
            "global_batch_size": gb}


def render(result: dict, as_json: bool) -> str:
    if as_json:
        return json.dumps(result)
    return (f"loss {result['loss']:.6f} perplexity {result['perplexity']:.4f} iteration {result['iteration']} "
            f"tokens {result['tokens']}")
