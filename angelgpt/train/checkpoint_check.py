"""What a checkpoint directory holds, read without torch: the launcher and `export`, `eval` and `generate`
refuse a missing, empty, incomplete or other-shaped checkpoint in one line before anything starts.

Layout (Megatron's): ``ROOT/latest_checkpointed_iteration.txt`` names the newest ``ROOT/iter_NNNNNNN/``,
which holds ``manifest.json`` (iteration, files with sizes and CRC32s, the saving run's config) once
complete. The sizes and checksums are verified where the checkpoint is read (`checkpoint.verify`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional

from angelgpt.config import ConfigError

TRACKER = "latest_checkpointed_iteration.txt"
MANIFEST = "manifest.json"

# the model fields that set a parameter's shape (or whether it exists), in the order a mismatch is named;
# the padded vocabulary is compared after them, seq_length only with learned position embeddings
SHAPE_FIELDS = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
                "ffn_hidden_size", "swiglu", "normalization", "add_bias_linear", "add_qkv_bias",
                "position_embedding_type", "untie_embeddings_and_output_weights")


def iter_dir(root: Path, iteration: int) -> Path:
    return Path(root) / f"iter_{iteration:07d}"


def latest_iteration(root: str) -> Optional[int]:
    """The iteration the tracker names, None without a tracker."""
    tracker = Path(root) / TRACKER
    if not tracker.is_file():
        return None
    text = tracker.read_text().strip()
    if not text.isdigit():
        raise ConfigError(f"checkpoint tracker {tracker} is corrupt: expected an iteration, got '{text[:40]}'")
    return int(text)


def iterations(root: Path) -> List[int]:
    """The iterations of the iter_NNNNNNN directories under root (complete or not)."""
    return sorted(int(p.name[5:]) for p in Path(root).glob("iter_???????") if p.is_dir() and p.name[5:].isdigit())


def is_hf_dir(path: str) -> bool:
    """A transformers model directory (config.json, no angelgpt checkpoint)."""
    p = Path(path)
    return (p / "config.json").is_file() and not (p / TRACKER).is_file() and not (p / MANIFEST).is_file()


def find_checkpoint(path: str, iteration: Optional[int] = None, what: str = "--load") -> Path:
    """The iteration directory to read, with a manifest that parses: ``path`` is a save directory (its
    tracker names the latest checkpoint, or ``iteration`` picks one) or one ``iter_NNNNNNN`` directory.
    `what` names the option in the refusal (``--load``, ``checkpoint.load``)."""
    root = Path(path)
    if not root.exists():
        raise ConfigError(f"{what} {path} does not exist")
    if not root.is_dir():
        raise ConfigError(f"{what} {path} is not a directory")
    if (root / MANIFEST).is_file() or root.name.startswith("iter_"):
        if iteration is not None and root.name != f"iter_{iteration:07d}":
            raise ConfigError(f"--iteration {iteration} does not name {root}; give the save directory above it")
        found = root
    else:
        present = iterations(root)
        if iteration is None:
            iteration = latest_iteration(str(root))
            if iteration is None:
                hint = (f" (it holds {', '.join(f'iter_{i:07d}' for i in present)}"
                        + (": pick one with --iteration)" if what == "--load" else ")")) if present else ""
                raise ConfigError(f"{what} {path} holds no checkpoint: no {TRACKER}{hint}")
            found = iter_dir(root, iteration)
            if not found.is_dir():
                raise ConfigError(f"{what} {path} is incomplete: {TRACKER} names iteration {iteration} but "
                                  f"{found.name} is missing")
        else:
            found = iter_dir(root, iteration)
            if not found.is_dir():
                listed = f"; it holds {', '.join(map(str, present))}" if present else ""
                raise ConfigError(f"{what} {path} has no checkpoint of iteration {iteration}{listed}")
    try:
        manifest(found)
    except ConfigError as exc:
        raise ConfigError(f"{what} {path}: {exc}") from None
    return found


def manifest(path: Path) -> dict:
    """The manifest of one iteration directory; a ConfigError when it is missing or does not parse."""
    f = Path(path) / MANIFEST
    if not f.is_file():
        raise ConfigError(f"checkpoint {path} is incomplete: it has no {MANIFEST}")
    try:
        data = json.loads(f.read_text())
        data["files"], int(data["iteration"])
    except (ValueError, KeyError, TypeError):
        raise ConfigError(f"checkpoint {path} is corrupted: {MANIFEST} does not parse") from None
    return data


def _padded_vocab(config: dict) -> Optional[int]:
    m, p = config.get("model", {}), config.get("parallel", {})
    try:
        multiple = int(m["make_vocab_size_divisible_by"]) * int(p.get("tensor_model_parallel_size", 1))
        return -(-int(m["vocab_size"]) // multiple) * multiple
    except (KeyError, TypeError, ValueError):
        return None


def model_mismatch(saved: dict, config: dict) -> Optional[str]:
    """The first field where the model of `config` (a run's config as a dict, `to_dict`) has parameters
    of other shapes than the checkpoint's (`saved`, its manifest's config), as
    ``model.hidden_size: checkpoint 64, config 128``; None when every parameter has the same shape.
    Fields that only change how the same parameters are trained (batch sizes, learning rate,
    iterations, parallel layout, recompute, offload) are not compared; a field the checkpoint's config
    lacks is not either."""
    old, new = saved.get("model", {}), config.get("model", {})
    fields = SHAPE_FIELDS
    if old.get("position_embedding_type", "learned_absolute") == "learned_absolute" == new.get(
            "position_embedding_type"):
        fields += ("seq_length",)  # the position-embedding table has seq_length rows
    for key in fields:
        if key in old and old[key] != new.get(key):
            return f"model.{key}: checkpoint {old[key]}, config {new.get(key)}"
    before, after = _padded_vocab(saved), _padded_vocab(config)
    if before is not None and before != after:
        if old.get("vocab_size") != new.get("vocab_size"):
            return f"model.vocab_size: checkpoint {old.get('vocab_size')}, config {new.get('vocab_size')}"
        return (f"padded vocabulary (model.make_vocab_size_divisible_by x parallel.tensor_model_parallel_size): "
                f"checkpoint {before}, config {after}")
    return None


def resume_root(load: Optional[str], save: Optional[str]) -> Optional[str]:
    """The directory a run resumes from: checkpoint.load, else checkpoint.save when it holds a
    checkpoint (a restarted run), else None."""
    return load or (save if save and latest_iteration(save) is not None else None)


def check_resume(config: dict) -> Optional[int]:
    """Before launch: the iteration the run resumes at (None for a fresh run), after refusing a resume
    directory that is missing, holds no complete checkpoint, or holds another model (ConfigError)."""
    ck = config["checkpoint"]
    root = resume_root(ck.get("load"), ck.get("save"))
    if root is None:
        return None
    what = "checkpoint.load" if ck.get("load") else "checkpoint.save"
    path = find_checkpoint(root, what=what)
    data = manifest(path)
    saved = data.get("config")
    problem = model_mismatch(saved, config) if isinstance(saved, dict) else None
    if problem:
        hint = "" if what == "checkpoint.load" else " (a run resumes from the checkpoint in its checkpoint.save: " \
                                                    "save elsewhere to train another model)"
        raise ConfigError(f"{what} {root} holds another model: {problem}{hint}")
    return int(data["iteration"])
