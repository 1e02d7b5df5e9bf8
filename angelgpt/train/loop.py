"""The training loop: forward-backward over micro batches, optimizer step, LR schedule, eval, log, save."""

from __future__ import annotations

import math
import time
from functools import partial
from typing import List

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from angelgpt import parallel
from angelgpt.config import Config
from angelgpt.data.dataset import micro_batches
from angelgpt.model.flops import flops_per_iteration
from angelgpt.parallel.log import EVERY_RANK, get_logger
from angelgpt.optimizer import Optimizer
from angelgpt.train import checkpoint
from angelgpt.train.checkpoint_check import resume_root
from angelgpt.train.step import forward_backward_cpu, forward_step, mean_loss, shared_p2p
from angelgpt.train.stop import RunControl, report_stop, reserve_s, save_estimate_s
from angelgpt.train.metrics import MetricsWriter, Profiling, gpu_alloc_retries, gpu_memory_gib, host_memory_gib

log = get_logger(__name__)


class TrainingAborted(RuntimeError):
    """Training cannot go on (for example, too many skipped iterations in a row)."""


class SaveFailed(TrainingAborted):
    """A checkpoint could not be saved; the previous one stays the latest."""


CLOSE_TIMEOUT_S = 60.0  # each of the optimizer, the metrics writers and a background write, after an error


def close_within(closers, timeout: float = CLOSE_TIMEOUT_S) -> List[str]:
    """Calls each (name, close) in turn on a daemon thread, waiting at most `timeout` seconds for each;
    the names of those that raised or did not end in time (a stuck one is left to end with the process)."""
    import threading

    failed = []
    for name, close in closers:
        error = []

        def run(close=close, error=error):
            try:
                close()
            except BaseException as exc:  # noqa: BLE001 (reported by name; the first error is what matters)
                error.append(exc)

        thread = threading.Thread(target=run, name=f"angelgpt-close-{name}", daemon=True)
        thread.start()
        thread.join(timeout)
        if thread.is_alive() or error:
            failed.append(name)
    return failed


class Trainer:
    def __init__(self, cfg: Config, model, optimizer: Optimizer, scheduler, train_ds, valid_ds, on_gpu: bool,
                 control: RunControl, rehearsal: bool = False, sharing=None):
        self.cfg = cfg
        self.control = control
        control.configure(cfg.checkpoint.stop_grace_s, cfg.train.exit_duration_mins)
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.train_ds = train_ds
        self.valid_ds = valid_ds
        self.on_gpu = on_gpu
        self.device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
        self.dp = parallel_state.get_data_parallel_world_size()
        self.num_microbatches = cfg.num_microbatches(self.dp)
        self.pipelined = parallel_state.get_pipeline_model_parallel_world_size() > 1
        if on_gpu:
            from megatron.core.pipeline_parallel import get_forward_backward_func

            self.forward_backward = get_forward_backward_func()
            # ranks sharing one GPU (parallel.DeviceSharing): a pipeline group of its backend carries
            # CUDA tensors only as it arranges
            if sharing is not None and self.pipelined and \
                    dist.get_backend(parallel_state.get_pipeline_model_parallel_group()) == sharing.backend:
                self.forward_backward = shared_p2p(self.forward_backward, model, sharing)
        elif self.pipelined:  # Megatron's 1F1B with its CUDA allocations kept on the CPU
            from angelgpt.parallel import cpu_schedules

            self.forward_backward = cpu_schedules.forward_backward_func()
        else:
            self.forward_backward = forward_backward_cpu
        owns_log = (parallel_state.is_pipeline_last_stage() and parallel_state.get_tensor_model_parallel_rank() == 0
                    and parallel_state.get_data_parallel_rank() == 0)
        self.owns_log = owns_log
        self.writer = None
        self.iteration = 0  # iterations done
        self.consumed = 0  # samples consumed
        self.skipped = 0  # iterations skipped (a non-finite loss or gradient norm)
        # a rehearsal (fake collectives: losses and norms are meaningless, non-finite ones included)
        # neither skips nor aborts on them, and records each iteration's times (device synchronized)
        self.rehearsal = rehearsal
        self.records: List[dict] = []
        self.saver = None  # checkpoint.Saver of checkpoint.save, made by train()
        self.last_eval_s = None  # the last evaluation's seconds, for the wall-clock limit's reserve
        self.trained = False  # whether this process trained an iteration (a stop may come before)

    def _clock(self) -> float:
        """Now; in a rehearsal on GPU after the device has finished what is queued."""
        if self.rehearsal and self.on_gpu:
            torch.cuda.synchronize()
        return time.perf_counter()

    def _run(self, iterator, forward_only: bool):
        from angelgpt.model.offload import offload_mode

        return self.forward_backward(
            forward_step_func=partial(forward_step, offload=offload_mode(self.cfg.model.activation_offload,
                                                                          self.on_gpu)), data_iterator=iterator,
            model=[self.model] if self.on_gpu or self.pipelined else self.model,
            num_microbatches=self.num_microbatches, seq_length=self.cfg.model.seq_length,
            micro_batch_size=self.cfg.train.micro_batch_size, forward_only=forward_only,
        )

    @torch.no_grad()
    def evaluate(self) -> float:
        started = time.perf_counter()
        self.model.eval()
        it = micro_batches(self.valid_ds, 0, self.cfg.train.micro_batch_size,
                           parallel_state.get_data_parallel_rank(), self.dp, self.device)
        losses = [mean_loss(self._run(it, forward_only=True), self.device) for _ in range(self.cfg.train.eval_iters)]
        self.model.train()
        self.last_eval_s = time.perf_counter() - started
        return sum(losses) / len(losses)

    def maybe_resume(self) -> None:
        """Resumes from checkpoint.load, else from checkpoint.save when it holds one (a restarted run)."""
        ck = self.cfg.checkpoint
        root = resume_root(ck.load, ck.save)  # as the launcher checked it
        if root:
            self.iteration, self.consumed = checkpoint.load(root, self.model, self.optimizer, self.scheduler)
            log.info(f"resumed from {root} at iteration {self.iteration}")

    def _optimizer_profile(self) -> dict:
        """The optimizer's transfer and update times of the last iteration, when it profiles them."""
        record = self.optimizer.profile_record()
        if not record:
            return {}
        if self.owns_log:
            log.info(self.optimizer.profile_line(), extra=EVERY_RANK)
        return {"zero_cache_profile": record}

    def save(self, last: bool) -> None:
        """A checkpoint of this iteration; with checkpoint.async_save written in the background, except the
        run's last one (nothing trains on while it is written). A save that fails stops training with one
        line naming the cause; the checkpoint before it stays the latest."""
        try:
            self.saver.save(self.iteration, self.consumed, self.model, self.optimizer, self.scheduler,
                            asynchronous=self.cfg.checkpoint.async_save and not last)
        except Exception as exc:
            if parallel.is_timeout(exc):
                raise
            latest = checkpoint.latest_iteration(self.cfg.checkpoint.save)
            cause = next((line.strip() for line in str(exc).splitlines() if line.strip()), "")
            kept = (f"the latest checkpoint is still iteration {latest}" if latest is not None
                    else "no earlier checkpoint exists")
            raise SaveFailed(f"the checkpoint of iteration {self.iteration} could not be saved in "
                             f"{self.cfg.checkpoint.save} ({type(exc).__name__}: {cause[:300]}); {kept}") from exc

    def _save_record(self) -> dict:
        """The checkpoint saves' times since the last record (stall_s: the loop blocked; write_s and
        finalize_s of the saves finalized since), for the metrics."""
        merged = self.saver.take_events() if self.saver else None
        return {"checkpoint": merged} if merged else {}

    def train(self) -> float:
        cfg = self.cfg
        world = dist.get_world_size()
        flops = flops_per_iteration(cfg)
        tokens_per_iter = cfg.train.global_batch_size * cfg.model.seq_length
        # a resumed run appends to its metrics file; a fresh one starts it anew
        self.writer = MetricsWriter.for_config(self.owns_log, cfg, append=self.iteration > 0)
        profiling = Profiling(cfg.logging, self.on_gpu, self.owns_log, self.iteration)
        it = micro_batches(self.train_ds, self.consumed, cfg.train.micro_batch_size,
                           parallel_state.get_data_parallel_rank(), self.dp, self.device)
        self.model.train()
        if cfg.checkpoint.save:
            from angelgpt.config import to_dict

            self.saver = checkpoint.Saver(cfg.checkpoint.save, to_dict(cfg), cfg.checkpoint.keep,
                                          cfg.checkpoint.multi_slice, self.device,
                                          cfg.parallel.distributed_timeout_minutes)
            if cfg.checkpoint.async_save and not self.rehearsal:  # said at start: the buffer will not fit
                from angelgpt.planner.systemplan import checkpoint_staging_bytes

                self.saver.room_for(checkpoint_staging_bytes(cfg, world, parallel_state.get_pipeline_model_parallel_rank()),
                                     asynchronous=True)
        try:
            loss, stop, aborting, in_a_row = self._iterations(it, profiling, flops, tokens_per_iter, world)
            if self.saver:  # the last save is synchronous: nothing is left in flight, but be sure
                self.saver.finalize(blocking=True)
                self.saver.staging.close()
        except BaseException:
            # this rank's write ends (or is left behind after its time); the save stays unfinalized
            # (iter_N.tmp); the optimizer's threads and files, the profiler and the metrics sinks close
            closers = [("checkpoint write", lambda: self.saver and self.saver.abandon(CLOSE_TIMEOUT_S)),
                       ("profiler", profiling.close), ("metrics writers", self.writer.close),
                       ("optimizer", self.optimizer.close)]
            stuck = close_within(closers)
            if stuck:
                log.warning(f"after the error, {', '.join(stuck)} did not close cleanly within "
                            f"{CLOSE_TIMEOUT_S:.0f} s each", extra=EVERY_RANK)
            raise
        profiling.close()
        self.writer.close()
        self.optimizer.close()
        if aborting:
            where = f"; the last good state is saved in {cfg.checkpoint.save}" if cfg.checkpoint.save else ""
            raise TrainingAborted(f"{in_a_row} consecutive iterations had a non-finite loss or gradient norm "
                                  f"(last at iteration {self.iteration}){where}")
        if stop and dist.get_rank() == 0:
            report_stop(self.control.reason, cfg.checkpoint.save, self.iteration, self.trained)
        return loss

    def _reserve_s(self, iteration_s: float) -> float:
        """stop.reserve_s at this boundary: the last save's and evaluation's seconds (before one was measured,
        an estimate from this rank's parameters, and a third of an iteration per validation batch)."""
        ck, tr = self.cfg.checkpoint, self.cfg.train
        measured = self.saver.last_save_s if self.saver is not None else None
        save_s = 0.0 if not ck.save else measured if measured is not None else save_estimate_s(
            sum(p.numel() for p in self.model.parameters()))
        eval_s = 0.0 if not (tr.eval_interval and self.valid_ds) else (
            self.last_eval_s if self.last_eval_s is not None else tr.eval_iters * iteration_s / 3)
        return reserve_s(iteration_s, save_s, eval_s, self._due(ck.save_interval), self._due(tr.eval_interval))

    def _due(self, interval) -> bool:
        """Whether this iteration is a boundary of an interval (save, evaluation, log, exit; None: never).
        The reserve of the wall-clock limit and the loop ask this one rule, so they agree on what is due."""
        return bool(interval and self.iteration % interval == 0)

    def _step(self, it):
        """One iteration's forward, backward and optimizer step; a non-finite loss on any rank leaves the
        weights alone. Returns (mean loss, stepped, grad norm or nan)."""
        self.control.phase = f"iteration {self.iteration + 1}: forward and backward"
        self.optimizer.zero_grad()
        started = self._clock()
        stats = self._run(it, forward_only=False)
        loss = mean_loss(stats, self.device)
        loss_ok = self.rehearsal or parallel.all_ranks(
            math.isfinite(loss) or not parallel_state.is_pipeline_last_stage(), self.device)
        backward_done = self._clock()
        if loss_ok:
            self.control.phase = f"iteration {self.iteration + 1}: optimizer step"
            ok, grad_norm, _ = self.optimizer.step()
        else:  # a non-finite loss: leave the weights alone
            ok, grad_norm = False, float("nan")
            self.optimizer.zero_grad()
        grad_norm = float(grad_norm) if grad_norm is not None else float("nan")
        if self.rehearsal:
            stepped = self._clock()
            self.records.append({"iteration": self.iteration + 1, "forward_backward_s": backward_done - started,
                                 "optimizer_step_s": stepped - backward_done, "loss": loss,
                                 "grad_norm": grad_norm, "stepped": bool(ok),
                                 "zero_cache_profile": self.optimizer.profile_record()})
        return loss, ok, grad_norm

    def _log(self, loss, val_loss, grad_norm, window_s, window_iters, flops, tokens_per_iter, world) -> None:
        """The metrics line of the iteration just done; speeds are the mean over the window's iterations."""
        if self.on_gpu:
            torch.cuda.synchronize()
        elapsed = (time.perf_counter() - window_s) / window_iters
        self.writer.log({
            "iteration": self.iteration,
            "lm_loss": loss,
            "val_loss": val_loss,
            "lr": self.optimizer.param_groups[0]["lr"],
            "grad_norm": grad_norm,
            "elapsed_ms": elapsed * 1000.0,
            "tokens_per_s": tokens_per_iter / elapsed,
            "tflops_per_gpu": flops / elapsed / world / 1e12,
            "mem_gpu_gib": gpu_memory_gib(),
            "mem_gpu_reserved_gib": gpu_memory_gib(reserved=True),
            "gpu_alloc_retries": gpu_alloc_retries(),
            "mem_host_gib": host_memory_gib(),
            "consumed_samples": self.consumed,
            **self._optimizer_profile(),
            **self._save_record(),
        }, self.cfg.train.train_iters, self.consumed, self.skipped)

    def _iterations(self, it, profiling, flops, tokens_per_iter, world):
        """Trains until the last iteration, a stop signal or too many skips: (last loss, stopped by a
        signal, aborting, non-finite iterations in a row)."""
        cfg = self.cfg
        loss = float("nan")
        window_start, window_iters = time.perf_counter(), 0
        last = self.iteration >= cfg.train.train_iters
        stop = aborting = False
        in_a_row = 0
        self.control.phase = f"iteration {self.iteration + 1}: start"
        if not last and self.control.stop_requested(self.device):  # asked to stop while setting up
            return loss, True, False, 0
        while not last:
            iteration_started = time.perf_counter()
            profiling.begin(self.iteration + 1)
            loss, ok, grad_norm = self._step(it)
            if ok and math.isfinite(grad_norm):
                self.scheduler.step(increment=1)
                in_a_row = 0
            else:
                self.skipped += 1
                in_a_row += 1
            self.iteration += 1
            self.consumed += cfg.train.global_batch_size
            window_iters += 1
            self.trained = True
            stop = self.control.stop_requested(self.device, self._reserve_s(time.perf_counter() - iteration_started))
            if self.saver:  # a background save whose write every rank has finished is made visible
                self.saver.finalize(blocking=False)
            aborting = in_a_row >= cfg.train.max_consecutive_skips and not self.rehearsal
            last = stop or aborting or self.iteration == cfg.train.train_iters or self._due(cfg.train.exit_interval)
            val_loss = None
            if cfg.train.eval_interval and (self._due(cfg.train.eval_interval) or last) and self.valid_ds:
                self.control.phase = f"iteration {self.iteration}: evaluation"
                val_loss = self.evaluate()
            if self._due(cfg.logging.log_interval) or last or val_loss is not None:
                self._log(loss, val_loss, grad_norm, window_start, window_iters, flops, tokens_per_iter, world)
                window_start, window_iters = time.perf_counter(), 0
            if cfg.checkpoint.save and (last or self._due(cfg.checkpoint.save_interval)):
                self.control.phase = f"iteration {self.iteration}: checkpoint save"
                self.save(last)
                window_start, window_iters = time.perf_counter(), 0
            if profiling.end(self.iteration):  # writing a trace or snapshot is not an iteration's time
                window_start, window_iters = time.perf_counter(), 0
        return loss, stop, aborting, in_a_row
