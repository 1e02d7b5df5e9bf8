"""Rank-aware logging for torchrun workers, through Python's `logging`.

    from angelgpt.parallel.log import get_logger, setup_logging
    setup_logging()                       # once, in the worker, after the process group exists
    log = get_logger(__name__)
    log.info("built the model")           # printed by rank 0 only
    log.info(line, extra=EVERY_RANK)      # printed by whichever rank calls it (the rank that owns the loss)
    setup_logging(rank_prefix=True)       # a rehearsed rank: its every INFO line, as '[rank R] ...'
    log.warning("slow step")              # any rank, on stderr, prefixed 'angelgpt: rank R: '

INFO lines carry no prefix, so Megatron-style iteration lines read as Megatron prints them.
"""

from __future__ import annotations

import logging
import os
import sys

ROOT = "angelgpt"
EVERY_RANK = {"every_rank": True}  # `extra` for an INFO line that any rank may print


def _rank() -> int:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    except Exception:  # pragma: no cover - torch missing or half torn down
        pass
    return int(os.environ.get("RANK", "0"))


class _RankZeroInfo(logging.Filter):
    """INFO and below from rank 0 (or marked EVERY_RANK; every rank's with `every_rank`); the stream handler
    for warnings takes the rest."""

    def __init__(self, every_rank: bool = False):
        super().__init__()
        self.every_rank = every_rank

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.WARNING:
            return False
        record.rank = _rank()
        return self.every_rank or getattr(record, "every_rank", False) or record.rank == 0


class _Warnings(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = _rank()
        return record.levelno >= logging.WARNING


def get_logger(name: str) -> logging.Logger:
    """A logger under the 'angelgpt' root ('angelgpt.train.loop' for that module)."""
    return logging.getLogger(name if name.startswith(ROOT) else f"{ROOT}.{name}")


def setup_logging(level: int = logging.INFO, rank_prefix: bool = False) -> None:
    """INFO to stdout (rank 0, unprefixed), WARNING and above to stderr from every rank with its rank.
    `rank_prefix` (a rehearsal, one process per rank, each the only one on its stdout): every rank's INFO,
    each line prefixed '[rank R] '. Safe to call again: handlers are installed once, by the first call."""
    root = logging.getLogger(ROOT)
    if getattr(root, "_angelgpt_configured", False):
        return
    out = logging.StreamHandler(sys.stdout)
    out.addFilter(_RankZeroInfo(every_rank=rank_prefix))
    out.setFormatter(logging.Formatter("[rank %(rank)s] %(message)s" if rank_prefix else "%(message)s"))
    err = logging.StreamHandler(sys.stderr)
    err.addFilter(_Warnings())
    err.setFormatter(logging.Formatter("angelgpt: rank %(rank)s: %(message)s"))
    root.addHandler(out)
    root.addHandler(err)
    root.setLevel(level)
    root.propagate = False
    root._angelgpt_configured = True  # type: ignore[attr-defined]
