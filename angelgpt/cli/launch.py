"""Build the torchrun command for `angelgpt train` and run it. No torch import here."""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Tuple

from angelgpt.train.lifetime import LAUNCHER_PID_ENV, agent_preexec


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


def nothing_to_train(cfg) -> bool:
    """Before launch: refuses (ConfigError) a checkpoint the run would resume from (checkpoint.load, or
    checkpoint.save holding one) that is missing, unfinished or of another model; True, having said so,
    when it is at train.train_iters already (nothing to launch: not an error)."""
    from angelgpt.config import to_dict
    from angelgpt.train.checkpoint_check import check_resume

    at = check_resume(to_dict(cfg))
    if at is None or at < cfg.train.train_iters:
        return False
    print(f"angelgpt: nothing to train: the checkpoint is at iteration {at} and train.train_iters is "
          f"{cfg.train.train_iters}; raise train.train_iters to train on", flush=True)
    return True


def torchrun_command(rdzv: Rendezvous, worker_args: List[str]) -> List[str]:
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
    return cmd + ["-m", "angelgpt.train.worker"] + worker_args


def worker_env(on_gpu: bool, nproc_per_node: int, optimizer: str = "megatron", max_restarts: int = 0) -> dict:
    env = dict(os.environ)
    if optimizer != "zero_cache":
        # Megatron's launch scripts use one hardware work queue; ZeRO-Cache needs several, or its
        # transfer streams' waits hold up the compute kernels queued behind them
        env.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
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
    return env


def queue_warning(env: dict, on_gpu: bool, optimizer: str) -> Optional[str]:
    """A warning line when the user's environment gives ZeRO-Cache one CUDA hardware work queue."""
    if on_gpu and optimizer == "zero_cache" and env.get("CUDA_DEVICE_MAX_CONNECTIONS") == "1":
        return ("angelgpt: warning: CUDA_DEVICE_MAX_CONNECTIONS=1 gives ZeRO-Cache one hardware work queue, so "
                "its transfer streams' waits hold up the compute queued behind them; unset it")
    return None


RUN_CONFIG = "run-config.yaml"


@contextlib.contextmanager
def run_config_file(cfg, machine, cmd: List[str], keep: bool = True):
    """The resolved config (every 'auto' a value) as the YAML file the workers build from, with the
    machine reading it was resolved for and the command line as comments above it: RUN_CONFIG in
    checkpoint.save (kept with the checkpoints) where `keep` (the launcher that holds the directory's
    lock: of several nodes, node 0), else in a temporary directory removed after the run. Written to a
    temporary name and renamed, so a reader never sees half a file; a directory that cannot take it is
    refused in one line."""
    import socket
    import tempfile

    import yaml

    from angelgpt.config import ConfigError, to_dict

    into_save = bool(cfg.checkpoint.save) and keep
    own = None if into_save else tempfile.mkdtemp(prefix="angelgpt-run-")
    folder = Path(cfg.checkpoint.save if into_save else own)
    path = folder / RUN_CONFIG
    text = (f"# the config `angelgpt train` resolved, which its workers build from\n"
            f"# command: {' '.join(shlex.quote(a) for a in sys.argv)}\n"
            f"# workers: {format_command(cmd)}\n"
            f"# machine reading: {machine.to_json() if machine is not None else 'none'}\n"
            + yaml.safe_dump(to_dict(cfg), sort_keys=False))
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{RUN_CONFIG}.{socket.gethostname()}.{os.getpid()}.tmp")
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError as exc:
        raise ConfigError(f"cannot write {path}: {exc.strerror or exc}") from None
    try:
        yield path
    finally:
        if own is not None:
            import shutil

            shutil.rmtree(own, ignore_errors=True)


def format_command(cmd: List[str]) -> str:
    return " ".join(shlex.quote(c) for c in cmd)


ERROR_PREFIX = "angelgpt: error: "


def run(cmd: List[str], env: dict) -> Tuple[int, Optional[str]]:
    """Runs torchrun, passing its stderr through. A worker that refuses its input prints one
    `angelgpt: error:` line and exits 2; torchrun's own failure report after it is dropped and 2
    is returned, so a refusal reads as one line whichever process found it. Returns the exit code and,
    for a worker killed by SIGKILL (the out-of-memory killer's signal), which cannot speak for itself,
    the reason to print."""
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True, errors="replace",
                            start_new_session=True,  # a terminal's Ctrl-C reaches the workers once, from here
                            preexec_fn=agent_preexec())  # the agent dies with this process, the workers follow
    previous = {sig: signal.signal(sig, lambda signum, frame: _forward(proc.pid, signum))
                for sig in (signal.SIGTERM, signal.SIGINT)}
    refused = killed = False
    for line in proc.stderr:
        killed = killed or "Signal 9 (SIGKILL)" in line
        if refused:
            continue
        if line.startswith(ERROR_PREFIX) or "]:" + ERROR_PREFIX in line:
            refused = True
            line = line[line.index(ERROR_PREFIX):]
        sys.stderr.write(line)
        sys.stderr.flush()
    rc = proc.wait()
    for sig, handler in previous.items():
        signal.signal(sig, handler)
    if refused and rc != 0:
        return 2, None
    # a worker killed by SIGKILL (the kernel's out-of-memory killer, most likely) cannot say why itself
    why = ("a worker was killed by SIGKILL, most likely by the kernel's out-of-memory killer (host memory ran "
           "out): check `angelgpt plan` for this config, lower zero_cache.host_max_gib or the model size") \
        if killed and rc != 0 else None
    return rc, why


def _forward(torchrun_pid: int, signum: int) -> None:
    """Passes a signal to the workers (not to torchrun, which would signal them a second time):
    the first makes them save at the next iteration boundary and exit 0, a second stops them at once."""
    import psutil

    try:
        workers = psutil.Process(torchrun_pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return
    for w in workers:
        try:
            if "angelgpt.train.worker" in " ".join(w.cmdline()):
                w.send_signal(signum)
        except psutil.NoSuchProcess:
            pass
