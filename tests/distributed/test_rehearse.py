"""`angelgpt rehearse` on CPU: a TP 2 x PP 2 x DP 2 job of 8 ranks (the tiny and the llama-tiny
preset) rehearsed one process per pipeline stage kind under torch's fake process group, each rank's
measurement beside the planner's prediction; a host budget too small exits 2 with one line naming what
ran out, a rank that outgrows its share of the node's host memory while it runs is stopped by the
launcher within seconds."""

import json
import time

import psutil
import pytest

from tests.helpers import check_one_line_error, run_cli

LAYOUT = ("--size", "tiny", "--device", "cpu", "--nproc-per-node", "8",
          "parallel.tensor_model_parallel_size=2", "parallel.pipeline_model_parallel_size=2")


def _mem_total_bytes():
    for line in open("/proc/meminfo"):
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no MemTotal")


@pytest.mark.parametrize("size", ["tiny", "llama-tiny"])
def test_rehearsal_of_each_stage_kind_reports_memory_beside_the_plan(tmp_path, size):
    report = tmp_path / "rehearsal.json"
    proc = run_cli("rehearse", "--size", size, *LAYOUT[2:], "optim.optimizer=zero_cache",
                   "zero_cache.prefetch_cache_sub_group_rate=0.5", "--report", report, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "rehearsal: every rehearsed rank fits" in proc.stdout
    data = json.loads(report.read_text())
    assert data["fits"] is True
    assert data["rehearsal"]["world_size"] == 8 and data["rehearsal"]["data_parallel_size"] == 2
    ranks = {r["rank"]: r for r in data["ranks"]}
    assert sorted(ranks) == [0, 4]  # rank 0 of the first stage and of the last
    assert [ranks[0]["stage"], ranks[4]["stage"]] == ["first", "last"]
    assert ranks[4]["coordinates"] == {"tp_rank": 0, "dp_rank": 0, "pp_rank": 1}
    assert "played" not in proc.stderr  # Megatron's parallel state put each rank where the launcher expected
    total = _mem_total_bytes()
    for r in ranks.values():
        m = r["measured"]
        assert r["fits"] and r["exit_code"] == 0 and r["ran_out"] is None
        assert r["cpu_threads"] == 1  # OMP_NUM_THREADS as run_cli sets it: the user's setting is kept
        assert r["predicted"]["step_here_s"] is None  # no GPU here: nothing to time it by
        assert 0 < m["host_peak_rss_bytes"] < total
        assert len(m["steps"]) == 3 and all(s["forward_backward_s"] > 0 for s in m["steps"])
        assert m["steps"][-1]["zero_cache_profile"] is not None
        assert 0 < m["zero_cache"]["tier_bytes"]["host"] < total
        p = r["predicted"]
        assert p["system"] == "zero_cache" and p["gpu_total_bytes"] > 0 and p["host_per_rank_bytes"] > 0
        assert "pipeline stage" in p["for"]
        assert f"rank {r['rank']} (node 0, {r['stage']} stage" in proc.stdout
    # the stages hold different parameters: the planner's prediction follows the stage played
    assert ranks[0]["predicted"]["gpu_bytes"] != ranks[4]["predicted"]["gpu_bytes"]
    assert data["predicted_communication"]["predicted"] is True
    assert "predicted by the planner" in proc.stdout


def test_rehearsal_short_of_host_memory_exits_2_naming_it(tmp_path):
    report = tmp_path / "short.json"
    # the node's host memory is plenty (the plan fits it: no refusal before building), ZeRO-Cache's host
    # tier is not
    proc = run_cli("rehearse", *LAYOUT, "optim.optimizer=zero_cache", "zero_cache.prefetch_cache_sub_group_rate=0.0",
                   "zero_cache.host_max_gib=0.0001", "--host-mem", "64", "--rank", "0", "--report", report,
                   timeout=600)
    check_one_line_error(proc, "ran out of host memory", in_worker=True)
    assert "rank 0 (first stage)" in proc.stderr
    data = json.loads(report.read_text())
    assert data["fits"] is False
    (r,) = data["ranks"]
    assert r["ran_out"]["resource"] == "host memory" and "host needs" in r["ran_out"]["message"]
    assert r["exit_code"] == 2


def test_a_rank_outgrowing_its_share_of_the_host_is_stopped_by_the_launcher(tmp_path):
    """125m on the CPU fits its plan's 1.8 GiB per rank of 16 GiB over 8 ranks, then outgrows the 2 GiB
    while it builds: the launcher kills it (not this machine's OOM killer) and stops, one line, exit 2."""
    report = tmp_path / "over.json"
    start = time.monotonic()
    proc = run_cli("rehearse", "--size", "125m", "--device", "cpu", "--nproc-per-node", "8",
                   "--host-mem", "16", "--steps", "1", "--report", report, timeout=600)
    assert time.monotonic() - start < 120
    check_one_line_error(proc, "rank 0 (only stage) used ", in_worker=True)
    assert "of host memory, over its budget of 2 GiB (2 GiB per rank: --host-mem 16 GiB per node over 8 ranks); " \
           "stopped by the launcher" in proc.stderr
    (r,) = json.loads(report.read_text())["ranks"]
    assert r["ran_out"]["resource"] == "host memory" and r["exit_code"] == -9
    assert r["measured"]["host_peak_rss_bytes"] > 2 * 1024 ** 3 == r["host_limit_bytes"]
    left = [p for p in psutil.process_iter(["cmdline"]) if str(report) in " ".join(p.info["cmdline"] or [])]
    assert not left  # no rehearsed rank left running


def test_every_rehearsed_ranks_worker_lines_are_shown_prefixed_by_its_rank():
    """Each rehearsed rank prints its own lines, not only rank 0 (and the loss owner's iteration lines),
    each prefixed '[rank R] ' so that the ranks' lines tell apart."""
    proc = run_cli("rehearse", "--size", "tiny", "--device", "cpu", "--nproc-per-node", "2",
                   "parallel.pipeline_model_parallel_size=2", "--steps", "1", "--host-mem", "64", timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    for rank in (0, 1):  # the first and the last stage
        assert f"[rank {rank}] training from iteration 0 to 1 (DP=1, TP=1, PP=2, device=cpu)" in lines, proc.stdout
    assert any(line.startswith("[rank 1]  iteration        1/       1 |") for line in lines), proc.stdout
    assert not any(line.startswith(("training from", " iteration")) for line in lines), proc.stdout
