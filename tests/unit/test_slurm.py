"""A multi-node Slurm job's shape from srun's environment: the hostlist parser, which flag takes which
variable, a given flag winning, and bad values refused in one line before anything is launched."""

import pytest

from angelgpt.cli.slurm import derived_port, fill, from_env, hostnames
from angelgpt.config import ConfigError
from tests.helpers import check_one_line_error, run_cli_in_process

JOB = {"SLURM_JOB_ID": "1234567", "SLURM_NNODES": "4", "SLURM_NODEID": "2", "SLURM_NTASKS": "4",
       "SLURM_JOB_NODELIST": "node[01-04]"}


@pytest.mark.parametrize("nodelist, hosts", [
    ("node01", ["node01"]),
    ("localhost,localhost", ["localhost", "localhost"]),
    ("node[01-04,07],gpu-a[1-2]", ["node01", "node02", "node03", "node04", "node07", "gpu-a1", "gpu-a2"]),
    ("n[8-11]", ["n8", "n9", "n10", "n11"]),
    ("n[098-101]", ["n098", "n099", "n100", "n101"]),
    ("rack[1-2]-n[08-09]", ["rack1-n08", "rack1-n09", "rack2-n08", "rack2-n09"]),
    ("a[3],b.example.org", ["a3", "b.example.org"]),
])
def test_hostlist_expands_like_scontrol_show_hostnames(nodelist, hosts):
    assert hostnames(nodelist) == hosts


@pytest.mark.parametrize("nodelist, why", [
    ("", "empty"), ("node[01-04", "'[' without ']'"), ("node01-04]", "']' without '['"),
    ("node[a-b]", "is not a list of numbers"), ("node[4-1]", "runs backwards"), ("a,,b", "an empty host name"),
    ("n[1-[2]]", "nested"), ("n[]", "is not a list of numbers"),
])
def test_malformed_hostlist_is_refused_naming_it(nodelist, why):
    with pytest.raises(ConfigError) as exc:
        hostnames(nodelist)
    assert why in str(exc.value)


def test_every_flag_not_given_comes_from_the_job():
    shape = from_env(JOB)
    assert (shape.nnodes, shape.node_rank, shape.master_addr, shape.master_port) == (4, 2, "node01", 44567)
    assert shape.line == ("slurm: 4 nodes, node rank 2, rendezvous node01:44567 (from SLURM_NNODES, SLURM_NODEID, "
                          "SLURM_JOB_NODELIST, SLURM_JOB_ID)")


def test_master_port_from_the_environment_and_the_job_id_otherwise():
    assert from_env(dict(JOB, MASTER_PORT="29500")).master_port == 29500
    assert from_env(JOB).master_port == derived_port(1234567)
    assert {derived_port(i) for i in (0, 49999, 50000, 10**9 + 7)} <= set(range(10000, 60000))
    assert derived_port(5) != derived_port(6)


def test_a_flag_given_wins_over_the_environment():
    shape = from_env(JOB, nnodes=8, node_rank=5, master_addr="head", master_port=1234)
    assert shape is None  # nothing left to take
    assert from_env(JOB, nnodes=1) is None  # one node of the allocation runs standalone
    shape = from_env(JOB, node_rank=3, master_port=4321)
    assert (shape.nnodes, shape.node_rank, shape.master_addr, shape.master_port) == (4, 3, "node01", 4321)
    assert "(from SLURM_NNODES, SLURM_JOB_NODELIST)" in shape.line
    # c10d rendezvous assigns node ranks: only the node count is taken
    shape = from_env(JOB, rdzv_endpoint="head:29400")
    assert (shape.nnodes, shape.master_addr, shape.master_port) == (4, None, None)
    assert shape.line == "slurm: 4 nodes (from SLURM_NNODES)"


@pytest.mark.parametrize("env", [{}, {"SLURM_JOB_ID": "5"}, {"SLURM_NNODES": "4"},
                                 dict(JOB, SLURM_NNODES="1", SLURM_NTASKS="1", SLURM_NODEID="0")],
                         ids=["no-slurm", "no-node-count", "no-job-id", "one-node"])
def test_outside_a_multi_node_job_nothing_is_taken(env):
    assert from_env(env) is None
    assert fill(None, None, None, None, None, env) == (1, 0, None, None)


@pytest.mark.parametrize("change, why", [
    ({"SLURM_NNODES": "four"}, "SLURM_NNODES='four' in the environment is not an integer >= 1"),
    ({"SLURM_NODEID": "4"}, "SLURM_NODEID=4 is not below the node count 4"),
    ({"SLURM_NODEID": "-1"}, "SLURM_NODEID='-1'"),
    ({"SLURM_JOB_NODELIST": "node[01-04"}, "Slurm hostlist 'node[01-04': '[' without ']'"),
    ({"MASTER_PORT": "70000"}, "MASTER_PORT=70000 is not a port"),
    ({"MASTER_PORT": "x"}, "MASTER_PORT='x'"),
    ({"SLURM_NTASKS": "32"}, "runs 32 tasks on 4 nodes (SLURM_NTASKS)"),
    ({"SLURM_NTASKS_PER_NODE": "8"}, "runs 8 tasks per node (SLURM_NTASKS_PER_NODE)"),
])
def test_bad_slurm_values_are_refused_in_one_line(change, why):
    with pytest.raises(ConfigError) as exc:
        from_env(dict(JOB, **change))
    assert why in str(exc.value)


def test_train_refuses_several_tasks_per_node_before_launching(monkeypatch):
    for k, v in dict(JOB, SLURM_NTASKS_PER_NODE="8", SLURM_NTASKS="32").items():
        monkeypatch.setenv(k, v)
    proc = run_cli_in_process("train", "--size", "tiny", "--device", "cpu", "--dry-run")
    check_one_line_error(proc, "use srun --ntasks-per-node=1")


def test_train_dry_run_takes_the_job_and_the_flags_given(monkeypatch):
    for k, v in JOB.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    proc = run_cli_in_process("train", "--size", "tiny", "--device", "cpu", "--dry-run", "--node-rank", "3",
                              "train.global_batch_size=16")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[0] == ("slurm: 4 nodes, node rank 3, rendezvous node01:44567 (from SLURM_NNODES, "
                                           "SLURM_JOB_NODELIST, SLURM_JOB_ID)")
    assert "--nnodes 4 --node-rank 3 --master-addr node01 --master-port 44567" in proc.stdout
