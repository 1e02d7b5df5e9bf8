"""Write a model as safetensors files, one tensor in memory at a time, sharded as transformers shards.

    from angelgpt.export.safetensors_writer import write_safetensors
    specs = [("a.weight", (4, 8), torch.float32, lambda: torch.zeros(4, 8)), ...]
    write_safetensors("out", specs, max_shard_bytes=parse_size("5GB"))

Every tensor's name, shape and dtype are known before any is made, so the shards are planned first
(in order, a new shard when the next tensor would pass ``max_shard_bytes``; a tensor larger than that
gets a shard of its own), each shard's safetensors header is written first and each tensor's bytes are
appended as it is made: memory holds one tensor, never a shard or the model. One shard is
``model.safetensors``; more are ``model-0000k-of-0000n.safetensors`` with
``model.safetensors.index.json`` (``metadata.total_size`` and ``weight_map``), as transformers writes.

The format (https://github.com/huggingface/safetensors): 8 bytes little-endian header length N, N bytes of
JSON ``{name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {"format": "pt"}}`` padded
with spaces to a multiple of 8, then the tensors' bytes, little-endian, C order.
"""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path
from typing import Callable, Iterable, List, Sequence, Tuple

import torch

from angelgpt.config import ConfigError

DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64"}
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"

Spec = Tuple[str, Tuple[int, ...], torch.dtype, Callable[[], torch.Tensor]]

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str) -> int:
    """'5GB' (decimal, as transformers reads it), '500MiB', '1000000' -> bytes."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([A-Za-z]*)\s*", str(text))
    unit = match.group(2).upper() if match else None
    if not match or unit not in _UNITS:
        raise ConfigError(f"--max-shard-size must be a size such as 5GB, 500MB or 2GiB, got '{text}'")
    size = int(float(match.group(1)) * _UNITS[unit])
    if size <= 0:
        raise ConfigError(f"--max-shard-size must be > 0, got '{text}'")
    return size


def nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n * torch.empty((), dtype=dtype).element_size()


def plan_shards(specs: Sequence[Spec], max_shard_bytes: int) -> List[List[Spec]]:
    shards: List[List[Spec]] = []
    size = 0
    for spec in specs:
        b = nbytes(spec[1], spec[2])
        if not shards or (size + b > max_shard_bytes and shards[-1]):
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += b
    return shards or [[]]


def shard_names(n: int) -> List[str]:
    return [SINGLE] if n == 1 else [f"model-{k:05d}-of-{n:05d}.safetensors" for k in range(1, n + 1)]


def _header(specs: Sequence[Spec]) -> bytes:
    header, offset = {}, 0
    for name, shape, dtype, _ in specs:
        b = nbytes(shape, dtype)
        header[name] = {"dtype": DTYPES[dtype], "shape": [int(s) for s in shape], "data_offsets": [offset, offset + b]}
        offset += b
    header["__metadata__"] = {"format": "pt"}
    text = json.dumps(header, separators=(",", ":")).encode()
    return text + b" " * (-len(text) % 8)


def write_shard(path: Path, specs: Sequence[Spec], progress=None) -> None:
    header = _header(specs)
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(header)))
        fh.write(header)
        for name, shape, dtype, make in specs:
            t = make()
            if tuple(t.shape) != tuple(shape) or t.dtype != dtype:
                raise RuntimeError(f"{name}: made {tuple(t.shape)} {t.dtype}, planned {tuple(shape)} {dtype}")
            fh.write(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data)
            del t
            if progress is not None:
                progress.update(1)
        fh.flush()


def write_safetensors(out_dir, specs: Iterable[Spec], max_shard_bytes: int, progress=None) -> List[str]:
    """Writes the shards (and the index when there are several) into out_dir; returns the file names."""
    out = Path(out_dir)
    shards = plan_shards(list(specs), max_shard_bytes)
    names = shard_names(len(shards))
    weight_map, total = {}, 0
    for name, shard in zip(names, shards):
        write_shard(out / name, shard, progress)
        for spec in shard:
            weight_map[spec[0]] = name
            total += nbytes(spec[1], spec[2])
    if len(names) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        return names + [INDEX]
    return names
