"""Read an angelgpt checkpoint's model weights one tensor at a time, with no model and no process group.

    from angelgpt.export.checkpoint_reader import CheckpointReader
    reader = CheckpointReader.open("runs/ck")             # the latest complete checkpoint there
    reader = CheckpointReader.open("runs/ck", iteration=20)
    reader.config["model"]["hidden_size"]                 # the run's config (the manifest's)
    reader.shape("decoder.layers.mlp.linear_fc1.weight", layer=3)   # torch.Size([ffn, hidden])
    w = reader.read("decoder.layers.mlp.linear_fc1.weight", layer=3)

A checkpoint directory is Megatron's torch_dist format, that is a PyTorch DCP directory: ``.metadata``
lists every stored tensor under its sharded key with its global shape and the chunks (tensor-parallel
shards, pipeline stages) it was written in. A tensor comes back whole, as its global shape says,
whatever TP/PP/DP layout wrote it: DCP reads the overlapping chunks and puts them together.

Key names are Megatron's sharded keys, never the module names of a built model. A layer's tensor is
stored one of two ways, and ``layer=`` reads either:
- Megatron's optimizers: one key per parameter for all layers, the global layer index prepended as
  the first axis (``decoder.layers.mlp.linear_fc1.weight``, shape ``[num_layers, ffn, hidden]``); one
  layer is read as a slice, so the other layers are never in memory;
- ZeRO-Cache: one key per layer, ``<key>.layer<global layer index>`` (``checkpoint_state.per_layer_keys``).

Only a complete checkpoint is read: the manifest's files, sizes and CRC32 must match
(``checkpoint.verify``); anything else is a ConfigError naming what is wrong.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Dict, Iterable, Optional, Tuple

import torch

from angelgpt.config import ConfigError

MODEL_PREFIXES = ("embedding.", "decoder.", "output_layer.")


def find_checkpoint(path: str, iteration: Optional[int] = None) -> Path:
    """The iteration directory to read (`checkpoint_check.find_checkpoint`: a save directory or one
    ``iter_NNNNNNN`` directory), verified against its manifest's sizes and CRC32s."""
    from angelgpt.train import checkpoint

    found = checkpoint.find_checkpoint(path, iteration)
    problem = checkpoint.verify(found)
    if problem:
        raise ConfigError(problem)
    return found


class _CachedMetadataReader:
    """A FileSystemReader whose metadata is parsed once (DCP reads it again at every load)."""

    def __new__(cls, path: Path):
        from torch.distributed.checkpoint import FileSystemReader

        class Reader(FileSystemReader):
            _metadata = None

            def read_metadata(self, *args, **kwargs):
                if self._metadata is None:
                    self._metadata = super().read_metadata(*args, **kwargs)
                return self._metadata

        return Reader(str(path))


def _slice_planner(offsets: Dict[str, Tuple[int, ...]]):
    """DCP's default load planner, reading into each destination tensor the region of the stored tensor
    that starts at the given offsets (DCP's own planner reads only whole tensors into plain ones)."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
    from torch.distributed.checkpoint.planner import LoadPlan
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    class SlicePlanner(DefaultLoadPlanner):
        def __init__(self):
            super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

        def create_local_plan(self) -> LoadPlan:
            items = []
            for fqn, dest in self.state_dict.items():
                chunk = ChunkStorageMetadata(offsets=torch.Size(offsets[fqn]), sizes=dest.size())
                items += create_read_items_for_chunk_list(fqn, self.metadata.state_dict_metadata[fqn], [chunk])
            return LoadPlan(items)

        def lookup_tensor(self, index):
            return self.state_dict[index.fqn]

    return SlicePlanner()


class CheckpointReader:
    """The model tensors of one verified checkpoint directory; see the module docstring."""

    def __init__(self, path: Path):
        from angelgpt.train import checkpoint

        self.path = Path(path)
        manifest = json.loads((self.path / checkpoint.MANIFEST).read_text())
        self.iteration = int(manifest["iteration"])
        self.config = manifest.get("config") or {}
        if "model" not in self.config:
            raise ConfigError(f"checkpoint {self.path}: its {checkpoint.MANIFEST} has no config (written by an "
                              f"older angelgpt?)")
        self._storage = _CachedMetadataReader(self.path)
        try:
            metadata = self._storage.read_metadata()
        except Exception as exc:
            raise ConfigError(f"checkpoint {self.path}: DCP metadata does not read: {str(exc).splitlines()[0][:200]}") from None
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        self._meta = {k: v for k, v in metadata.state_dict_metadata.items()
                      if isinstance(v, TensorStorageMetadata) and k.startswith(MODEL_PREFIXES)}
        if not self._meta:
            raise ConfigError(f"checkpoint {self.path} holds no model tensors")

    @classmethod
    def open(cls, path: str, iteration: Optional[int] = None) -> "CheckpointReader":
        return cls(find_checkpoint(path, iteration))

    def keys(self) -> Iterable[str]:
        """The stored model keys (stacked and per-layer ones as stored)."""
        return self._meta.keys()

    def _locate(self, key: str, layer: Optional[int]) -> Tuple[str, Tuple[int, ...], torch.Size]:
        """(stored key, offsets into it, shape of what is read) of a logical tensor."""
        if layer is None:
            if key not in self._meta:
                raise KeyError(key)
            return key, (0,) * len(self._meta[key].size), self._meta[key].size
        per_layer = f"{key}.layer{layer}"
        if per_layer in self._meta:
            size = self._meta[per_layer].size
            return per_layer, (0,) * len(size), size
        if key in self._meta and layer < self._meta[key].size[0]:
            size = self._meta[key].size
            return key, (layer,) + (0,) * (len(size) - 1), size[1:]
        raise KeyError(f"{key} (layer {layer})")

    def has(self, key: str, layer: Optional[int] = None) -> bool:
        try:
            self._locate(key, layer)
        except KeyError:
            return False
        return True

    def shape(self, key: str, layer: Optional[int] = None) -> torch.Size:
        return self._locate(key, layer)[2]

    def dtype(self, key: str, layer: Optional[int] = None) -> torch.dtype:
        return self._meta[self._locate(key, layer)[0]].properties.dtype

    def num_layers(self) -> int:
        """Layers as stored (the stacked axis, or the per-layer keys' indices)."""
        n = 0
        for key, md in self._meta.items():
            if key.startswith("decoder.layers."):
                tail = key.rsplit(".layer", 1)
                if len(tail) == 2 and tail[1].isdigit():
                    n = max(n, int(tail[1]) + 1)
                else:
                    n = max(n, md.size[0])
        return n

    def read_into(self, key: str, dest: torch.Tensor, layer: Optional[int] = None,
                  offsets: Optional[Tuple[int, ...]] = None) -> torch.Tensor:
        """Fills dest (a CPU tensor of the stored dtype) with the region of the logical tensor starting at
        offsets (zeros when None); dest's shape is the region's."""
        from torch.distributed.checkpoint import load

        stored, base, _ = self._locate(key, layer)
        region = tuple(offsets) if offsets is not None else (0,) * dest.dim()
        if layer is not None and len(base) == dest.dim() + 1:  # a slice of the stacked layer axis
            target, start = dest.unsqueeze(0), (base[0],) + region
        else:
            target, start = dest, region
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            load({stored: target}, storage_reader=self._storage, planner=_slice_planner({stored: start}), no_dist=True)
        return dest

    def read(self, key: str, layer: Optional[int] = None, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """One logical tensor, whole (its global shape), as stored or converted to dtype."""
        out = torch.empty(self.shape(key, layer), dtype=self.dtype(key, layer))
        self.read_into(key, out, layer)
        return out if dtype is None or dtype == out.dtype else out.to(dtype)
