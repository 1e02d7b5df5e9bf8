"""The commands `angelgpt train` runs on the run config it writes (torchrun's workers, a rehearsal's
ranks), and torchrun run. No torch import here."""

from __future__ import annotations

import os
import re
import shlex
import signal
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Tuple

from angelgpt.train.lifetime import LAUNCHER_PID_ENV, agent_preexec
from angelgpt.train.stop import DEFAULT_GRACE_S, JOB_START_ENV, STOP_FILE_ENV, STOP_SIGNALS



@dataclass
class Rendezvous:
    nproc_per_node: int
    nnodes: int = 1
    node_rank: int = 0
    master_addr: Optional[str] = None
    master_port: Optional[int] = None
    rdzv_endpoint: Optional[str] = None
    max_restarts: int = 0


def fail(message: str) -> None:
    """Bad input: one line on stderr, exit code 2."""
    print(f"angelgpt: error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def resume_point(cfg) -> Optional[int]:
    """Before launch: the iteration of the checkpoint the run would resume from (checkpoint.load, or
    checkpoint.save holding one), None when it starts fresh; refuses (ConfigError) one that is missing,
    unfinished or of another model."""
    from angelgpt.config import to_dict
    from angelgpt.train.checkpoint_check import check_resume

    return check_resume(to_dict(cfg))


def nothing_to_train(cfg, at: Optional[int]) -> bool:
    """True, having said so, when the checkpoint resumed from is at train.train_iters already (nothing to
    launch: not an error)."""
    if at is None or at < cfg.train.train_iters:
        return False
    print(f"angelgpt: nothing to train: the checkpoint is at iteration {at} and train.train_iters is "
          f"{cfg.train.train_iters}; raise train.train_iters to train on", flush=True)
    return True


def torchrun_command(rdzv: Rendezvous, entry: List[str]) -> List[str]:
    """torchrun with `rdzv`'s rendezvous, running `entry` (`-m MODULE ARGS...`) on each worker."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(rdzv.nproc_per_node)]
    if rdzv.rdzv_endpoint:
        cmd += ["--nnodes", str(rdzv.nnodes), "--rdzv-backend", "c10d", "--rdzv-endpoint", rdzv.rdzv_endpoint]
    elif rdzv.nnodes > 1 or rdzv.master_addr:
        cmd += ["--nnodes", str(rdzv.nnodes), "--node-rank", str(rdzv.node_rank),
                "--master-addr", rdzv.master_addr or "127.0.0.1", "--master-port", str(rdzv.master_port or 29500)]
    else:
        cmd += ["--standalone"]
    if rdzv.max_restarts:
        cmd += ["--max-restarts", str(rdzv.max_restarts)]
    # stop requests are the workers' to handle (angelgpt.train.stop): the agent's own handling of SIGTERM
    # and SIGINT would end them 30 s after one, mid-save
    cmd += ["--signals-to-handle", "SIGHUP,SIGQUIT"]
    return cmd + entry


def worker_env(on_gpu: bool, nproc_per_node: int, optimizer: str = "megatron", max_restarts: int = 0) -> dict:
    from angelgpt.config import optimizers

    env = dict(os.environ)
    # the optimizer's own (its spec's env): Megatron's launch scripts use one hardware work queue;
    # ZeRO-Cache needs several, or its transfer streams' waits hold up the compute kernels queued behind them
    for key, value in optimizers.get(optimizer).env.items():
        env.setdefault(key, value)
    env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // max(1, nproc_per_node))))
    env.setdefault("PYTHONWARNINGS", "ignore")
    if max_restarts:
        # workers sharing torchrun's rendezvous store read the previous attempt's addresses after a
        # restart (pytorch/pytorch#135712); their own store keeps --max-restarts working. Without
        # restarts they share it: their own store listens on a port torchrun found free and let go,
        # which another job starting beside this one may take first (EADDRINUSE before any step)
        env.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    # the workers end themselves when this launcher is gone (angelgpt.train.lifetime.watch_launcher)
    env[LAUNCHER_PID_ENV] = str(os.getpid())
    import psutil

    env[JOB_START_ENV] = repr(psutil.Process().create_time())  # train.exit_duration_mins counts from it
    return env


def queue_warning(env: dict, on_gpu: bool, optimizer: str) -> Optional[str]:
    """A warning line when the user's environment gives ZeRO-Cache (an optimizer that needs several) one
    CUDA hardware work queue."""
    from angelgpt.config import optimizers

    if on_gpu and optimizers.get(optimizer).needs_several_cuda_work_queues and \
            env.get("CUDA_DEVICE_MAX_CONNECTIONS") == "1":
        return ("angelgpt: warning: CUDA_DEVICE_MAX_CONNECTIONS=1 gives ZeRO-Cache one hardware work queue, so "
                "its transfer streams' waits hold up the compute queued behind them; unset it")
    return None


RUN_CONFIG = "run-config.yaml"
WORKER = "angelgpt.train.worker"


def worker_command(rdzv: Rendezvous, run_config: Path) -> List[str]:
    """torchrun running the workers on the resolved run config at `run_config` (their only input)."""
    return torchrun_command(rdzv, ["-m", WORKER, "--run-config", str(run_config)])


def rank_command(folder: str, cfg, machine) -> List[str]:
    """A rehearsed rank's command (angelgpt.train.rehearse), on the run config `cfg` (resolved for
    `machine`) that it writes into `folder`."""
    cmd = [sys.executable, "-m", "angelgpt.train.rehearse", "--run-config", os.path.join(folder, RUN_CONFIG)]
    write_run_config(cmd[-1], cfg, machine, cmd)
    return cmd


def run_config_folder(cfg, keep: bool, dry_run: bool) -> Tuple[Path, bool]:
    """Where the run config goes, and whether that folder is the run's own, removed after it: the run's
    checkpoint.save (kept with the checkpoints) where `keep` (the launcher that holds the directory's lock:
    of several nodes, node 0), else a new temporary directory. A dry run's is a new temporary directory
    that stays (its printed command reads it; checkpoint.save may be a running job's)."""
    if cfg.checkpoint.save and keep and not dry_run:
        return Path(cfg.checkpoint.save), False
    return Path(tempfile.mkdtemp(prefix="angelgpt-run-")), not dry_run


def write_run_config(path, cfg, machine, cmd: List[str]) -> None:
    """The resolved config (every 'auto' a value) as the YAML file the workers build from, with the
    machine reading it was resolved for and the command lines as comments above it. Written to a
    temporary name and renamed, so a reader never sees half a file; a directory that cannot take it is
    refused in one line."""
    import socket

    import yaml

    from angelgpt.config import ConfigError, to_dict

    path = Path(path)
    text = (f"# the config `angelgpt train` resolved, which its workers build from\n"
            f"# command: {' '.join(shlex.quote(a) for a in sys.argv)}\n"
            f"# workers: {format_command(cmd)}\n"
            f"# machine reading: {machine.to_json() if machine is not None else 'none'}\n"
            + yaml.safe_dump(to_dict(cfg), sort_keys=False))
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{socket.gethostname()}.{os.getpid()}.tmp")
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError as exc:
        raise ConfigError(f"cannot write {path}: {exc.strerror or exc}") from None


def format_command(cmd: List[str]) -> str:
    return " ".join(shlex.quote(c) for c in cmd)


ERROR_PREFIX = "angelgpt: error: "


def run(cmd: List[str], env: dict, grace_s: float = DEFAULT_GRACE_S, max_restarts: int = 0) -> Tuple[int, Optional[str]]:
    """Runs torchrun, passing its stderr through. A worker that refuses its input prints one
    `angelgpt: error:` line and exits 2; torchrun's own failure report after it is dropped and 2
    is returned, so a refusal reads as one line whichever process found it. Returns the exit code and,
    for a worker killed by SIGKILL (the out-of-memory killer's signal), which cannot speak for itself,
    the reason to print.

    A stop request to this process (SIGTERM, SIGINT, SIGUSR1) becomes the stop file the workers look for
    at each iteration boundary (angelgpt.train.stop): they save and exit 0, rank 0 saying where in one
    line. The torchrun agent ignores those signals (its own handling would end the workers 30 s after
    one), so a signal to the whole job reaches each worker once, directly, and this launcher once.
    The same request again within `grace_s` changes nothing; a later one kills the job at once.
    With `max_restarts`, each failed worker that torchrun restarts the job after is told in one line."""
    stop_dir = tempfile.mkdtemp(prefix="angelgpt-stop-")
    env = {**env, STOP_FILE_ENV: os.path.join(stop_dir, "stop")}
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True, errors="replace",
                            start_new_session=True,  # a terminal's Ctrl-C reaches this launcher only
                            preexec_fn=_agent_preexec())
    stop = _StopRequests(proc.pid, env[STOP_FILE_ENV], grace_s)
    previous = {sig: signal.signal(sig, stop.handle) for sig in STOP_SIGNALS}
    refused = killed = False
    restarts = 0
    try:
        for line in proc.stderr:
            killed = killed or "Signal 9 (SIGKILL)" in line
            failed = _FAILED_WORKER.search(line)
            if failed and restarts < max_restarts:
                restarts += 1
                code = int(failed.group(1))
                how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
                sys.stderr.write(f"angelgpt: worker local rank {failed.group(2)} {how}: every worker restarts from "
                                 f"the latest checkpoint (restart {restarts} of {max_restarts}, --max-restarts)\n")
            if refused:
                continue
            if line.startswith(ERROR_PREFIX) or "]:" + ERROR_PREFIX in line:
                refused = True
                line = line[line.index(ERROR_PREFIX):]
            sys.stderr.write(line)
            sys.stderr.flush()
        rc = proc.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        shutil.rmtree(stop_dir, ignore_errors=True)
    if stop.ended_by is not None:
        return 128 + stop.ended_by, (f"asked to stop again {grace_s:g} s (checkpoint.stop_grace_s) after the first "
                                     f"request: the job was ended without finishing its save")
    if refused and rc != 0:
        return 2, None
    # a worker killed by SIGKILL (the kernel's out-of-memory killer, most likely) cannot say why itself
    why = ("a worker was killed by SIGKILL, most likely by the kernel's out-of-memory killer (host memory ran "
           "out): check `angelgpt plan` for this config, lower zero_cache.host_max_gib or the model size") \
        if killed and rc != 0 else None
    return rc, why


# torchrun's report of a failed worker (torch.distributed.elastic.multiprocessing.api)
_FAILED_WORKER = re.compile(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+)")


def _agent_preexec():
    """The torchrun agent's start: stop signals ignored (its workers set their own handlers), and
    lifetime.agent_preexec's tie to this launcher."""
    tie = agent_preexec()

    def preexec() -> None:
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
        if tie is not None:
            tie()

    return preexec


class _StopRequests:
    """The launcher's signal handler: the first stop request writes the stop file (naming the signal),
    repeats within the grace are ignored, one after it kills the agent and its workers at once."""

    def __init__(self, agent_pid: int, path: str, grace_s: float):
        self.agent_pid, self.path, self.grace_s = agent_pid, path, grace_s
        self.first_at: Optional[float] = None
        self.ended_by: Optional[int] = None

    def handle(self, signum, frame) -> None:
        now = time.monotonic()
        if self.first_at is None:
            self.first_at = now
            tmp = self.path + ".tmp"
            with open(tmp, "w") as fh:
                fh.write(signal.Signals(signum).name + "\n")
            os.replace(tmp, self.path)
        elif now - self.first_at > self.grace_s and self.ended_by is None:
            self.ended_by = signum
            _kill_tree(self.agent_pid)


def _kill_tree(pid: int) -> None:
    """SIGKILL to a process and every process under it."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = root.children(recursive=True) + [root]
    except psutil.NoSuchProcess:
        return
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
