"""Raw text to Megatron's indexed format: `angelgpt data prepare`.

    angelgpt data prepare --input corpus.txt --tokenizer runs/tok --output data/corpus --workers 2

Local .jsonl/.json/.txt/.parquet/.csv files (or globs) or a hub dataset name go through the
`datasets` library, are tokenized in parallel (`datasets.map`, batched, num_proc) and written with
Megatron's IndexedDatasetBuilder to PREFIX_text_document.bin/.idx (uint16 tokens when the vocabulary
fits, else int32). A .txt file holds one document per blank-line-separated paragraph. Bytes that are
not UTF-8 are replaced (U+FFFD) and counted. Output is written under temporary names and renamed
at the end, so a failure leaves no half-written pair behind; the output's directory is created when
missing (once the input has been read). Progress bars (tokenizing, writing) go to stderr when it is a
terminal, or when asked for (progress=True, or ANGELGPT_PROGRESS=1).
"""

from __future__ import annotations

import functools
import itertools
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from angelgpt.config import ConfigError
from angelgpt.data.sources import load_source
from angelgpt.data.tokenizer import load_tokenizer, progress_bar, show_progress

SUFFIX = "_text_document"


@dataclass
class PrepareSummary:
    documents: int
    tokens: int
    bytes: int
    seconds: float
    replaced_bytes: int
    prefix: str

    def line(self) -> str:
        return (f"wrote {self.prefix}.bin/.idx: {self.documents:,} documents, {self.tokens:,} tokens, "
                f"{self.bytes:,} bytes in {self.seconds:.1f} s ({self.tokens / max(self.seconds, 1e-9):,.0f} tokens/s)"
                + (f"; {self.replaced_bytes:,} non-UTF-8 bytes replaced" if self.replaced_bytes else ""))


def prepare(input_spec: str, tokenizer_dir: str, output_prefix: str, split: str = "train", text_key: str = "text",
            workers: int = 1, append_eod: bool = False, progress: Optional[bool] = None) -> PrepareSummary:
    """progress: True or False draws progress bars or not; None (the default) draws them when stderr is
    a terminal (tokenizer.show_progress)."""
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    start = time.perf_counter()
    tok = load_tokenizer(tokenizer_dir)
    out_dir = _creatable_dir(Path(output_prefix).resolve().parent)
    prefix = str(Path(output_prefix).resolve()) + SUFFIX
    with tempfile.TemporaryDirectory(prefix="angelgpt-prepare-") as scratch_dir:
        scratch = Path(scratch_dir)
        ds, replaced = load_source(input_spec, split, scratch)
        if text_key not in ds.column_names:
            raise ConfigError(f"--text-key: column '{text_key}' not in the data (columns: {', '.join(ds.column_names)})")
        ds = ds.select_columns([text_key])
        ds = ds.filter(lambda batch: [bool(t and t.strip()) for t in batch[text_key]], batched=True, batch_size=2048)
        if len(ds) == 0:
            raise ConfigError(f"--input: {input_spec} holds no non-empty documents")
        shown = show_progress(progress)
        if shown or (shown is None and sys.stderr.isatty()):
            import datasets

            datasets.enable_progress_bars()
        eod = tok.eod if append_eod else None
        dtype = DType.optimal_dtype(tok.vocab_size)
        shards = scratch / "shards"
        shards.mkdir()
        # Each map worker appends its documents' tokens to its own shard file, in order, and returns
        # only the lengths; the shards are concatenated in rank order (datasets shards contiguously).
        lengths_ds = ds.map(_encode_batch, batched=True, batch_size=1024, with_rank=True,
                            num_proc=workers if workers > 1 else None, remove_columns=[text_key],
                            load_from_cache_file=False, desc="tokenizing",
                            fn_kwargs={"spec": tokenizer_dir, "text_key": text_key, "eod": eod,
                                       "shard_dir": str(shards), "dtype": np.dtype(dtype).str})
        lengths = lengths_ds.data.column("length").to_numpy().astype(np.int64)
        tokens = int(lengths.sum())
        keep = lengths > 0
        documents = int(keep.sum())
        if documents == 0:
            raise ConfigError(f"--input: {input_spec} tokenizes to no tokens")
        tmp_prefix = f"{prefix}.tmp{os.getpid()}"
        try:
            out_dir.mkdir(parents=True, exist_ok=True)
            builder = IndexedDatasetBuilder(tmp_prefix + ".bin", dtype=dtype)
            with progress_bar(progress, total=tokens, unit="tok", unit_scale=True, desc="writing") as bar:
                for shard in sorted(shards.iterdir()):
                    with open(shard, "rb") as fh:
                        while chunk := fh.read(64 << 20):
                            builder.data_file.write(chunk)
                            bar.update(len(chunk) // np.dtype(dtype).itemsize)
            builder.sequence_lengths.extend(lengths[keep].tolist())
            builder.document_indices.extend(range(1, documents + 1))
            builder.finalize(tmp_prefix + ".idx")
            os.replace(tmp_prefix + ".bin", prefix + ".bin")
            os.replace(tmp_prefix + ".idx", prefix + ".idx")
        except OSError as exc:
            raise ConfigError(f"--output: cannot write {prefix}.bin/.idx in {out_dir}: "
                              f"{exc.strerror or type(exc).__name__}") from None
        finally:
            for ext in (".bin", ".idx"):
                if os.path.exists(tmp_prefix + ext):
                    os.remove(tmp_prefix + ext)
    size = os.path.getsize(prefix + ".bin") + os.path.getsize(prefix + ".idx")
    return PrepareSummary(documents, tokens, size, time.perf_counter() - start, replaced, prefix)


@functools.lru_cache(maxsize=None)
def _encoder(spec: str):
    """The tokenizer of a datasets.map worker process, loaded once per process."""
    return load_tokenizer(spec)


def _encode_batch(batch, rank: Optional[int], spec: str, text_key: str, eod: Optional[int], shard_dir: str,
                  dtype: str):
    """datasets.map worker: encode a batch and append its tokens to this worker's shard file."""
    tok = _encoder(spec)
    ids = tok.tokenize_batch(batch[text_key])
    if eod is not None:
        for x in ids:
            x.append(eod)
    flat = np.fromiter(itertools.chain.from_iterable(ids), dtype=np.dtype(dtype), count=sum(map(len, ids)))
    with open(os.path.join(shard_dir, f"shard{rank or 0:05d}.bin"), "ab") as fh:
        fh.write(flat.tobytes())
    return {"length": [len(x) for x in ids]}


def _creatable_dir(out_dir: Path) -> Path:
    """out_dir, when it is a directory or can be made one (its nearest existing ancestor is a directory
    this process may write in); else a one-line error. It is created only once the input has been read."""
    existing = out_dir
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"--output: cannot create directory {out_dir}: {existing} is not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"--output: directory {out_dir} is not writable" if existing == out_dir
                          else f"--output: cannot create directory {out_dir}: {existing} is not writable")
    return out_dir
