"""A stop is a save: what asks a run to stop, and how every rank agrees to stop at the same boundary.

A stop request is SIGTERM, SIGINT or SIGUSR1 (a scheduler's habits: `scancel`, Ctrl-C, Slurm's
`--signal=USR1@120`) to the launcher, to a worker or to both, or the job's wall-clock limit
(train.exit_duration_mins) coming near. The launcher turns a signal into a file (STOP_FILE_ENV) that
its workers look for at each iteration boundary, so a worker still setting up, or one the signal did
not reach, stops all the same. The first request starts the stop; the same request again within
checkpoint.stop_grace_s changes nothing (one signal often arrives several times: to the launcher and
its workers, to a process group twice); one arriving after the grace ends the process at once.
No torch import at module level: the launcher reads the names here.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Optional

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
STOP_FILE_ENV = "ANGELGPT_STOP_FILE"  # set by the launcher: the file whose existence asks to stop
JOB_START_ENV = "ANGELGPT_JOB_START"  # set by the launcher: the job's start (time.time()), for the limit
DEFAULT_GRACE_S = 900.0  # until the config is read (checkpoint.stop_grace_s)
SAVE_ESTIMATE_BYTES_PER_PARAM = 16  # before a save was measured: bf16 weight, fp32 master, two moments...
SAVE_ESTIMATE_BYTES_PER_S = 1e9  # ... written at 1 GB/s
RESERVE_FACTOR = 1.5  # the wall-clock limit's reserve (reserve_s) is half again what it must hold,
RESERVE_MIN_S = 2.0  # and at least this (a tiny model's iteration and save are shorter than a pause)

SIGNAL = 1  # reasons, in the order the agreed (largest) one is told
DURATION = 2


class RunControl:
    """What a worker's signal handlers, its training loop and its error report share: the stop requested
    (by a signal, the launcher's stop file or the wall-clock limit) and what training is doing (`phase`,
    named by a rank that reports a collective timing out)."""

    def __init__(self):
        self.first_signal: Optional[int] = None
        self.first_at: Optional[float] = None
        self.grace_s = DEFAULT_GRACE_S
        self.phase = "set-up"
        self.stop_file = os.environ.get(STOP_FILE_ENV) or None
        start = os.environ.get(JOB_START_ENV, "")
        self.job_start = float(start) if start.replace(".", "", 1).isdigit() else time.time()
        self.deadline: Optional[float] = None  # time.time() by which the job must have ended
        self.reason: Optional[str] = None  # why the run stopped, once agreed

    def configure(self, grace_s: float, exit_duration_mins: Optional[float]) -> None:
        self.grace_s = grace_s
        self.deadline = self.job_start + exit_duration_mins * 60.0 if exit_duration_mins else None

    def _handler(self, signum, frame) -> None:
        now = time.monotonic()
        if self.first_at is None:
            self.first_signal, self.first_at = signum, now
        elif now - self.first_at > self.grace_s:  # asked again after the grace: the save is given up
            os._exit(128 + signum)

    def install_signal_handlers(self) -> "RunControl":
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._handler)
        return self

    def _requested_by(self) -> Optional[str]:
        """The stop signal's name, this process's own or the one the launcher's stop file names."""
        if self.first_signal is not None:
            return signal.Signals(self.first_signal).name
        if self.stop_file:
            try:
                with open(self.stop_file) as fh:
                    return fh.read().strip() or "stop requested"
            except OSError:
                return None
        return None

    def _local_reason(self, reserve_s: float) -> int:
        if self._requested_by() is not None:
            return SIGNAL
        if self.deadline is not None and time.time() + reserve_s >= self.deadline:
            return DURATION
        return 0

    def stop_requested(self, device, reserve_s: float = 0.0) -> bool:
        """True on every rank once any rank has been asked to stop, or once the wall-clock limit leaves
        less than `reserve_s` seconds (the function reserve_s: what they hold) on any rank. A collective."""
        import torch
        import torch.distributed as dist

        flag = torch.tensor([float(self._local_reason(reserve_s))], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        reason = int(flag.item())
        if reason and self.reason is None:
            self.reason = self._describe(reason)
        return bool(reason)

    def _describe(self, reason: int) -> str:
        if reason == DURATION:
            return f"train.exit_duration_mins: {(self.deadline - self.job_start) / 60.0:g} min"
        return self._requested_by() or "stop requested on another rank"


def reserve_s(iteration_s: float, save_s: float, eval_s: float, save_due: bool, eval_due: bool) -> float:
    """Seconds an iteration boundary must leave before the wall-clock limit for the run to go on: what
    is due at it anyway (an interval save, an evaluation), one more iteration, and the evaluation and
    save a stop ends with; half again for safety, at least RESERVE_MIN_S. save_s and eval_s are 0 for a
    run that does neither."""
    due = (save_s if save_due else 0.0) + (eval_s if eval_due else 0.0)
    return max(RESERVE_MIN_S, RESERVE_FACTOR * (due + iteration_s + eval_s + save_s))


def save_estimate_s(local_params: int) -> float:
    """Seconds a first save is taken to need, before one was measured."""
    return local_params * SAVE_ESTIMATE_BYTES_PER_PARAM / SAVE_ESTIMATE_BYTES_PER_S


def report_stop(reason: str, save: Optional[str], iteration: int, trained: bool) -> None:
    """The one line a stopped run ends with (rank 0 calls it, on stderr): where it stopped, why, what
    was saved."""
    import sys

    from angelgpt.train.checkpoint_check import iter_dir, latest_iteration

    if trained:
        where = f"saved {iter_dir(save, iteration)}" if save else "nothing was saved (no --save)"
        what = f"stopped at iteration {iteration}"
    else:
        latest = latest_iteration(save) if save else None
        where = "nothing new to save" + (f"; the latest checkpoint is {iter_dir(save, latest)}"
                                         if latest is not None else "")
        what = f"stopped before iteration {iteration + 1}"
    print(f"angelgpt: {what} ({reason}): {where}", file=sys.stderr, flush=True)
