"""Input files and datasets to a `datasets.Dataset`: the file formats angelgpt reads, shared by
`data prepare` (prepare.py) and `tokenizer train` (tokenizer.py); imports neither.

Local .jsonl/.json/.txt/.parquet/.csv files (or globs) are read with the `datasets` library (a .txt
file holds one document per blank-line-separated paragraph); anything else is taken for a hub
dataset name. Bytes that are not UTF-8 are replaced (U+FFFD) and counted.
"""

from __future__ import annotations

import codecs
import glob
import os
from pathlib import Path
from typing import List, Optional, Tuple

from angelgpt.config import ConfigError

FORMATS = {".jsonl": "json", ".json": "json", ".txt": "text", ".parquet": "parquet", ".csv": "csv"}


def local_files(spec: str) -> Optional[List[str]]:
    """The files a path or glob names; None when it looks like a dataset name instead."""
    looks_local = any(c in spec for c in "*?[") or spec.startswith(("/", ".", "~")) or os.path.exists(spec) \
        or Path(spec).suffix.lower() in FORMATS
    if not looks_local:
        return None
    files = sorted(glob.glob(spec)) if any(c in spec for c in "*?[") else [spec]
    files = [f for f in files if os.path.isfile(f)]
    if not files:
        raise ConfigError(f"--input: no such file: {spec}")
    kinds = {Path(f).suffix.lower() for f in files}
    unknown = kinds - set(FORMATS)
    if unknown:
        raise ConfigError(f"--input: unsupported file type {sorted(unknown)[0] or '(none)'}; "
                          f"use {', '.join(FORMATS)}")
    if len({FORMATS[k] for k in kinds}) > 1:
        raise ConfigError("--input: files of one format at a time, got " + ", ".join(sorted(kinds)))
    return files


def _utf8_clean(files: List[str], scratch: Path) -> Tuple[List[str], int]:
    """Files with invalid UTF-8 are copied with each bad byte replaced by U+FFFD; returns the count."""
    replaced = 0
    out = []

    def counting(err: UnicodeDecodeError):
        nonlocal replaced
        replaced += err.end - err.start
        return "\ufffd", err.end

    codecs.register_error("angelgpt_count", counting)
    for i, f in enumerate(files):
        raw = Path(f).read_bytes()
        try:
            raw.decode("utf-8")
            out.append(f)
        except UnicodeDecodeError:
            clean = scratch / f"clean{i}{Path(f).suffix}"
            clean.write_text(raw.decode("utf-8", errors="angelgpt_count"), encoding="utf-8")
            out.append(str(clean))
    return out, replaced


def load_source(spec: str, split: str, scratch: Path):
    """(dataset, non-UTF-8 bytes replaced) for a local path/glob or a hub dataset name; scratch holds
    cleaned copies and the datasets cache. Bad input raises a one-line ConfigError."""
    import datasets

    datasets.disable_progress_bars()
    files = local_files(spec)
    if files is None:
        try:
            return datasets.load_dataset(spec, split=split), 0
        except Exception as exc:
            text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            offline = os.environ.get("HF_HUB_OFFLINE") == "1" or "connect" in text.lower() or "offline" in text.lower()
            hint = "the HuggingFace hub is not reachable (offline); " if offline else ""
            raise ConfigError(f"--input: cannot load dataset '{spec}': {hint}give a local .jsonl/.json/.txt/"
                              f".parquet/.csv path instead ({text[:120]})") from None
    kind = FORMATS[Path(files[0]).suffix.lower()]
    if kind != "parquet":
        files, replaced = _utf8_clean(files, scratch)
    else:
        replaced = 0
    kwargs = {"sample_by": "paragraph"} if kind == "text" else {}
    try:
        ds = datasets.load_dataset(kind, data_files=files, split="train", cache_dir=str(scratch / "cache"), **kwargs)
    except Exception as exc:
        raise ConfigError(f"--input: cannot read {files[0]} as {kind}: {str(exc).splitlines()[0][:160]}") from None
    return ds, replaced
