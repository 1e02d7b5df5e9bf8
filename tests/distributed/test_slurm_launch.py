"""srun's environment alone is enough to start a multi-node job: two launchers on this machine, each
told only what Slurm tells a node (SLURM_JOB_ID, SLURM_NNODES, SLURM_NODEID, SLURM_JOB_NODELIST,
MASTER_PORT), train one job of world size 2."""

import os
import socket
import subprocess
import sys

import pytest

from tests.helpers import ROOT, failure_report, read_metrics, train_tiny

pytestmark = pytest.mark.distributed


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_srun_variables_alone_start_a_two_node_cpu_job(tmp_path):
    port = free_port()
    metrics = tmp_path / "m.jsonl"
    nodes = []
    for node in (0, 1):
        env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1", SLURM_JOB_ID="4242", SLURM_NNODES="2",
                   SLURM_NODEID=str(node), SLURM_NTASKS="2", SLURM_JOB_NODELIST="localhost,localhost",
                   MASTER_PORT=str(port))
        with open(tmp_path / f"out{node}", "w") as out, open(tmp_path / f"err{node}", "w") as err:
            nodes.append(subprocess.Popen(
                [sys.executable, "-m", "angelgpt", "train", "--size", "tiny", "--device", "cpu", "--nproc-per-node",
                 "1", "train.train_iters=4", "logging.log_interval=1", "--metrics-file", metrics],
                cwd=ROOT, env=env, stdout=out, stderr=err, text=True))
    try:
        codes = [p.wait(timeout=300) for p in nodes]
    finally:
        for p in nodes:
            p.kill()
    outs = [(tmp_path / f"out{n}").read_text() for n in (0, 1)]
    for n, p in enumerate(nodes):
        err = (tmp_path / f"err{n}").read_text()
        assert codes[n] == 0, failure_report(subprocess.CompletedProcess(p.args, codes[n], outs[n], err))
        assert outs[n].splitlines()[0] == (f"slurm: 2 nodes, node rank {n}, rendezvous localhost:{port} (from "
                                           f"SLURM_NNODES, SLURM_NODEID, SLURM_JOB_NODELIST, MASTER_PORT)")
        assert "world size 2 = TP 1 x PP 1 x DP 2" in outs[n]
        assert f"--nnodes 2 --node-rank {n} --master-addr localhost --master-port {port}" in outs[n]
    assert "training from iteration 0 to 4 (DP=2" in outs[0]
    # the same job as two workers under one launcher: the same losses
    one_node = train_tiny(tmp_path, "one-node", "train.train_iters=4", nproc=2)
    assert [r["lm_loss"] for r in read_metrics(metrics)] == [r["lm_loss"] for r in one_node]
