"""Train/valid GPT datasets through Megatron's BlendedMegatronDatasetBuilder, and the sample order.

The order is Megatron's "single" sampler: global sample k of the run is dataset index k (the
dataset shuffles internally from the seed), each data-parallel rank reading its slice of every
micro batch. Resuming from ``consumed_samples`` therefore replays the exact same stream.
"""

from __future__ import annotations

from typing import Dict, Iterator

import torch

from angelgpt.config import Config


def _ensure_helpers() -> None:
    """Megatron's index helpers are C++; wheels ship them built, source trees compile them once."""
    try:
        from megatron.core.datasets import helpers_cpp  # noqa: F401
    except ImportError:
        from megatron.core.datasets.utils import compile_helpers

        compile_helpers()


def build_datasets(cfg: Config, tokenizer, train_samples: int, valid_samples: int):
    """Returns (train, valid) datasets; valid is None when the split gives it nothing."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset

    _ensure_helpers()
    from megatron.core.datasets.utils import get_blend_from_list

    cfg.data.check_files()
    paths = cfg.data.paths
    blend = None if cfg.data.is_mock else get_blend_from_list([str(x) for x in ([paths] if isinstance(paths, str) else paths)])
    ds_config = GPTDatasetConfig(
        random_seed=cfg.train.seed,
        sequence_length=cfg.model.seq_length,
        blend=blend,
        split=cfg.data.split,
        path_to_cache=cfg.data.cache_path,
        tokenizer=tokenizer,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,
    )
    cls = MockGPTDataset if cfg.data.is_mock else GPTDataset
    train, valid, _ = BlendedMegatronDatasetBuilder(
        cls, [train_samples, valid_samples, 0], lambda: True, ds_config
    ).build()
    return train, valid


def micro_batches(dataset, start_sample: int, micro_batch_size: int, dp_rank: int, dp_size: int,
                  device: torch.device) -> Iterator[Dict[str, torch.Tensor]]:
    """Endless stream of this rank's micro batches from global sample ``start_sample`` on."""
    step = micro_batch_size * dp_size
    k = start_sample
    while True:
        first = k + dp_rank * micro_batch_size
        samples = [dataset[(first + i) % len(dataset)] for i in range(micro_batch_size)]
        batch = {key: torch.stack([torch.as_tensor(s[key]) for s in samples])
                 for key in ("tokens", "labels", "loss_mask", "position_ids")}
        yield {key: t.to(device, non_blocking=True) for key, t in batch.items()}  # each [b, s]
        k += step
