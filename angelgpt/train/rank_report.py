"""What a rehearsed rank reports of itself: `RankReport` (angelgpt.train.rehearse writes it, `angelgpt
rehearse` reads it back) and its parts, `RanOut` and `Measured` (with each `Step` timed and, under
ZeRO-Cache, `ZeroCacheMeasured`).

Their JSON is what the rehearsal's report holds of the rank, key for key: a part the rank never reached
(`coordinates`, `config`, `measured`) and a figure it did not take (a field of `Measured` left None) are
left out, not written as null; `ran_out` and `error` are always there, null when nothing ran short or
failed. `RankReport.from_json` of a report's JSON is that report. No torch import.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Dict, List, Optional


def _finite(value):
    """A float that is not finite as None (JSON has no NaN); anything else as it is."""
    return None if isinstance(value, float) and not math.isfinite(value) else value


@dataclass(frozen=True)
class RanOut:
    """What ran short (`resource`: 'GPU memory', 'host memory', ...), the error's first line or the
    launcher's message, and who stopped the rank (`by`; None when the rank stopped itself)."""

    resource: str
    message: str
    by: Optional[str] = None

    def to_json(self) -> dict:
        return {"resource": self.resource, **({"by": self.by} if self.by is not None else {}),
                "message": self.message}


@dataclass(frozen=True)
class Step:
    """One rehearsed iteration as the training loop recorded it: its times (device synchronized), its loss
    and gradient norm (None where not finite: under fake collectives they mean nothing), whether the
    optimizer stepped, and ZeRO-Cache's profile of it (None for another optimizer)."""

    iteration: int
    forward_backward_s: float
    optimizer_step_s: float
    loss: Optional[float]
    grad_norm: Optional[float]
    stepped: bool
    zero_cache_profile: Optional[Dict[str, float]]

    @classmethod
    def of_record(cls, record: dict) -> "Step":
        """From one of the training loop's records (Trainer.records, the same keys)."""
        return cls(**{k: _finite(v) for k, v in record.items()})


@dataclass(frozen=True)
class ZeroCacheMeasured:
    """ZeRO-Cache's placement on the rank: the bytes each tier holds, the host memory pinned, the bytes
    its layout planned per tier, and its one-line summary."""

    tier_bytes: Dict[str, int]
    host_pinned_bytes: int
    planned_bytes: Dict[str, int]
    summary: str


@dataclass(frozen=True)
class Measured:
    """What was measured of the rank: its peak RSS (the rank's own, or the launcher's watcher's when it
    stopped the rank); the GPU allocator's peaks (0 on the CPU) and allocation retries (on a GPU; nonzero:
    it reached the cap, so the peak reserved is the cap's); each step (None when no trainer was built);
    ZeRO-Cache's placement. None: not measured, and left out of the JSON."""

    host_peak_rss_bytes: int
    gpu_peak_allocated_bytes: Optional[int] = None
    gpu_peak_reserved_bytes: Optional[int] = None
    gpu_alloc_retries: Optional[int] = None
    steps: Optional[List[Step]] = None
    zero_cache: Optional[ZeroCacheMeasured] = None

    def to_json(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}

    @classmethod
    def from_json(cls, d: dict) -> "Measured":
        steps, zc = d.get("steps"), d.get("zero_cache")
        return cls(**{**d, "steps": None if steps is None else [Step(**s) for s in steps],
                      "zero_cache": None if zc is None else ZeroCacheMeasured(**zc)})


@dataclass
class RankReport:
    """What a rehearsed rank reports of itself: whether it ran its steps (`fits`), and if not what ran
    short (`ran_out`) or the error that stopped it (`error`; at most one of the two is set); where it ran
    ('cpu' or 'cuda'); where Megatron's parallel state put it (tp_rank, pp_rank, dp_rank) and its settings
    as resolved, once it was built; what was measured of it."""

    rank: int
    device: str = "cpu"
    fits: bool = False
    ran_out: Optional[RanOut] = None
    error: Optional[str] = None
    coordinates: Optional[Dict[str, int]] = None
    config: Optional[Dict[str, Any]] = None
    measured: Optional[Measured] = None

    def to_json(self) -> dict:
        reached = {"coordinates": self.coordinates, "config": self.config}
        return {"rank": self.rank, "fits": self.fits, "ran_out": self.ran_out.to_json() if self.ran_out else None,
                "error": self.error, **{k: v for k, v in reached.items() if v is not None}, "device": self.device,
                **({"measured": self.measured.to_json()} if self.measured is not None else {})}

    @classmethod
    def from_json(cls, d: dict) -> "RankReport":
        ran_out, measured = d.get("ran_out"), d.get("measured")
        return cls(rank=d["rank"], device=d["device"], fits=d["fits"],
                   ran_out=RanOut(**ran_out) if ran_out is not None else None, error=d.get("error"),
                   coordinates=d.get("coordinates"), config=d.get("config"),
                   measured=Measured.from_json(measured) if measured is not None else None)
