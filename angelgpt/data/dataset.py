"""Train/valid GPT datasets through Megatron's BlendedMegatronDatasetBuilder, and the sample order.

The order is Megatron's "single" sampler: global sample k of the run is dataset index k (the
dataset shuffles internally from the seed), each data-parallel rank reading its slice of every
micro batch. Resuming from ``consumed_samples`` therefore replays the exact same stream.
"""

from __future__ import annotations

from typing import Dict, Iterator, List, Optional, Tuple

import torch

from angelgpt.config import Config, ConfigError


def _ensure_helpers() -> None:
    """Megatron's index helpers are C++; wheels ship them built, source trees compile them once."""
    try:
        from megatron.core.datasets import helpers_cpp  # noqa: F401
    except ImportError:
        from megatron.core.datasets.utils import compile_helpers

        compile_helpers()


SPLITS = ("training", "validation", "test")


def split_sequences(split: str, sequences: int) -> List[Optional[int]]:
    """Sequences each of the train, validation and test splits takes of a dataset of `sequences` (one a
    document for `data prepare`'s): Megatron's split matrix, each bound rounded as its dataset builder
    rounds it; None for a split of share 0 (Megatron builds none)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets.blended_megatron_dataset_config import (
            convert_split_vector_to_split_matrix, parse_and_normalize_split)

    matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(split))
    return [None if bounds is None else int(round(bounds[1] * sequences)) - int(round(bounds[0] * sequences))
            for bounds in matrix]


def split_sizes(cfg: Config) -> List[Tuple[str, int, List[Optional[int]]]]:
    """Per dataset of data.paths (none for mock data): its prefix, its sequences and what each split takes."""
    if cfg.data.is_mock:
        return []
    import warnings

    with warnings.catch_warnings():  # megatron.core's import warns of what is not installed: not the user's problem
        warnings.simplefilter("ignore")
        from megatron.core.datasets.indexed_dataset import IndexedDataset

    items = [cfg.data.paths] if isinstance(cfg.data.paths, str) else list(cfg.data.paths)
    out = []
    for prefix in (items[1::2] if len(items) > 1 else items):
        sequences = len(IndexedDataset(str(prefix)).sequence_lengths)
        out.append((str(prefix), sequences, split_sequences(cfg.data.split, sequences)))
    return out


def check_splits(cfg: Config, validating: bool, sizes=None) -> None:
    """Refuses (one line) a data.split that gives the training split, or the validation split when
    evaluations are asked for, no sequence of some dataset. (Megatron's builder would look for samples
    in an empty split forever; the splits nothing is asked of are left out when they are empty:
    build_datasets.) `sizes`: split_sizes(cfg), where the caller has it."""
    for prefix, sequences, counts in split_sizes(cfg) if sizes is None else sizes:
        for k in (0, 1) if validating else (0,):
            if not counts[k]:
                raise ConfigError(f"data.split {cfg.data.split} gives the {SPLITS[k]} split none of the {sequences} "
                                  f"sequences of {prefix}; give it a larger share, or more documents"
                                  + ("" if k == 0 else ", or leave train.eval_interval unset"))


def build_datasets(cfg: Config, tokenizer, train_samples: int, valid_samples: int):
    """Returns (train, valid) datasets; valid is None when the split gives it nothing."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset

    _ensure_helpers()
    from megatron.core.datasets.utils import get_blend_from_list

    cfg.data.check_files()
    sizes = split_sizes(cfg)
    check_splits(cfg, valid_samples > 0, sizes)
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
    # a split nothing is asked of that holds no sequence of some dataset (the test split, the validation
    # split without evaluations: small corpora) is not built; Megatron would look for its samples forever
    for prefix, sequences, counts in sizes:
        for k in (1, 2) if not valid_samples else (2,):
            if counts[k] == 0:
                ds_config.split_matrix[k] = None
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
