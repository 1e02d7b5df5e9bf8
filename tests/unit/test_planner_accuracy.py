"""The planner against measurements it was not fitted to: the committed H200 runs of the validation set
and the rehearsal reports, with the calibration runs (those that set its constants) kept apart.
Declared in tests/data/planner_runs.json; loaded and compared by tests/planner_runs.py."""

import json
import re

import pytest

from angelgpt.planner.machines import H200_STEP_RUNS, MACHINES
from tests.planner_runs import (GIB, PLANNER_SOURCES, RESULTS, TOLERANCE, config_of, declared, measured_and_planned,
                                misses, rehearsal_points, result)
from tests.helpers import ROOT

RUNS = declared()


def _completed_training_runs():
    """Committed H200 results of `angelgpt train` runs that completed steps."""
    for f in sorted(RESULTS.glob("*.json")):
        r = json.loads(f.read_text())
        if (isinstance(r, dict) and "angelgpt" in str(r.get("command", "")).split()[:3]
                and r.get("returncode") == 0 and r.get("elapsed_ms_median")):
            yield f.name, r


def test_calibration_and_validation_runs_are_kept_apart():
    """Each completed H200 training run is in exactly one of calibration, validation or excluded; every
    calibration run is named in the planner's source and every result file named there is calibration;
    every reconstruction and unchecked quantity says why."""
    cal, val, exc = set(RUNS["calibration"]), set(RUNS["validation"]), set(RUNS["excluded"])
    assert not (cal & val) and not (cal & exc) and not (val & exc), (cal & val, cal & exc, val & exc)
    for name in cal | val | exc:
        assert (RESULTS / name).is_file(), name
    source = "".join(p.read_text() for p in PLANNER_SOURCES)
    named = {n for n in re.findall(r"[\w.-]+\.json", source) if (RESULTS / n).is_file()}
    assert named == cal, {"named in the source, not calibration": named - cal, "calibration, not named": cal - named}
    completed = {name for name, _ in _completed_training_runs()}
    assert completed - cal - val - exc == set(), "runs neither calibration, validation nor excluded"
    assert val <= completed, val - completed
    for name, entry in RUNS["validation"].items():
        assert set(entry) <= {"overrides", "why", "unchecked"}, (name, entry)
        assert bool(entry.get("overrides")) == bool(entry.get("why")), name
        assert set(entry.get("unchecked", {})) <= set(TOLERANCE) and all(entry.get("unchecked", {}).values()), name
        assert set(TOLERANCE) - set(entry.get("unchecked", {})), f"{name}: nothing left to check"
    assert all(RUNS["excluded"].values())


def test_the_h200_figures_name_their_calibration_runs():
    """A measured H200 figure names the committed runs it came from, all of them calibration; the compute
    rate's runs (H200_STEP_RUNS) are completed H200 training runs."""
    cal = set(RUNS["calibration"])
    assert set(H200_STEP_RUNS) <= cal and len(H200_STEP_RUNS) == len(set(H200_STEP_RUNS))
    completed = dict(_completed_training_runs())
    assert all(n in completed and "H200" in completed[n]["machine"]["gpu"] for n in H200_STEP_RUNS)
    for figure, source in MACHINES["h200"].sources.items():
        assert source.startswith(("measured: ", "assumed: ")), (figure, source)
        for name in re.findall(r"[\w.-]+\.json", source):
            assert name in cal, (figure, name)
    assert "H200_STEP_RUNS" in MACHINES["h200"].sources["gpu_tflops"]


def test_validation_covers_both_optimizers_the_planner_is_asked_for_most():
    systems = {config_of(result(n)).optim.optimizer for n in RUNS["validation"]}
    assert {"megatron", "zero_cache"} <= systems, systems


@pytest.mark.parametrize("name", sorted(RUNS["validation"]))
def test_prediction_matches_a_validation_run(name):
    """Peak GPU memory and host memory within 10%, step time within 15%, of what the H200 measured in a
    run no planner constant was fitted to (a quantity declared unchecked, with its reason, is skipped)."""
    run, entry = result(name), RUNS["validation"][name]
    assert "H200" in run["machine"]["gpu"]
    measured, planned, p = measured_and_planned(run, tuple(entry.get("overrides", ())))
    assert misses(measured, planned, skip=entry.get("unchecked", {})) == {}, (p.gpu_bytes, p.host_bytes, p.step_s)


def test_a_run_is_planned_as_it_settled():
    """The config of a run is what it printed it settled: at ecf8257 the launcher planned 14 recomputed
    layers but the worker recomputed 18 and placed states at rate 0.42; gradients added up in bf16."""
    cfg = config_of(result("refactor-zero_cache-L19-mb2-gb32-recomputeauto-at-ecf8257.json"))
    assert (cfg.model.recompute, cfg.model.recompute_num_layers) == ("full", 18)
    assert cfg.zero_cache.prefetch_cache_sub_group_rate == 0.42 and cfg.zero_cache.offload_params is False
    assert cfg.zero_cache.device_update_fraction == 0.42 and cfg.model.activation_offload == "none"
    assert getattr(cfg.optim, "accumulate_grads_in_fp32", False) is False


def _rehearsal_reports():
    return sorted(ROOT.glob(RUNS["rehearsals"]))


def _rehearsal_params():
    known = RUNS.get("rehearsal_misses", {})
    return [pytest.param(p, marks=pytest.mark.xfail(strict=True, reason=known[p.name]["why"]))
            if p.name in known else p for p in _rehearsal_reports()]


@pytest.mark.parametrize("path", _rehearsal_params(), ids=lambda p: p.stem)
def test_rehearsal_report_matches_its_prediction(path):
    """Every committed rehearsal report: each rank's peak GPU memory and host memory within the same
    tolerances of the planner's per-rank prediction recorded beside it, and its step time within the step
    tolerance of the planner's step on the machine that rehearsed (reports before that prediction: the
    forward-backward time against the planner's compute time there; rehearsal_points). A miss the
    planner is known to make is declared, with why, under 'rehearsal_misses' (a strict xfail: it fails
    once the planner no longer misses it); a quantity not compared is declared, with why, under
    'rehearsal_unchecked'."""
    off = {}
    skip = RUNS.get("rehearsal_unchecked", {}).get(path.name, {}).get("quantities", ())
    for label, measured, predicted, failure in rehearsal_points(json.loads(path.read_text())):
        assert failure is None, failure
        miss = misses(measured, predicted, skip)
        if miss:
            off[label] = miss
    known = RUNS.get("rehearsal_misses", {}).get(path.name)
    if known:  # only the quantities declared may miss
        assert set().union(*[set(m) for m in off.values()]) <= set(known["quantities"]), off
    assert off == {}, off


def _rank(rank, gpu_gib, rss_gib, pred_gpu_gib, pred_host_gib, fits=True, predicted_fits=True, device="cuda",
          reserved_gib=0.0, fb=(9.0,), compute_here=None, step_here=None):
    return {"rank": rank, "stage": "first", "fits": fits, "device": device,
            "ran_out": None if fits else {"resource": "GPU memory", "message": "CUDA out of memory"},
            "measured": {"gpu_peak_allocated_bytes": int(gpu_gib * GIB), "host_peak_rss_bytes": int(rss_gib * GIB),
                         "gpu_peak_reserved_bytes": int(reserved_gib * GIB),
                         "steps": [{"forward_backward_s": v, "optimizer_step_s": 0.1} for v in fb]},
            "predicted": {"fits": predicted_fits, "gpu_total_bytes": int(pred_gpu_gib * GIB),
                          "host_per_rank_bytes": int(pred_host_gib * GIB), "step_time_s": 1.0,
                          "compute_here_s": compute_here, "step_here_s": step_here}}


def test_rehearsal_comparison_on_a_synthetic_report():
    """Within 10% passes; 11% off in GPU memory or host memory is a miss; the GPU figure is the peak
    allocated plus the CUDA context, whatever the allocator reserved beyond it (cache it gives back under
    pressure: 28 GiB allocated and 35 reserved meet a plan of 30, 28 allocated miss a plan of 33); the
    median step (forward-backward plus optimizer step) of steps 2.. is compared with the planner's step on
    the rehearsing machine where the report has it, else the median forward-backward time with the
    planner's compute time on that GPU (within 15%), and not at all where the report has neither; a CPU
    rehearsal compares host memory only; a rank that ran out where the planner said it fits is a failure,
    one predicted not to fit is not compared."""
    report = {"ranks": [_rank(0, 35.0, 20.0, 38.0, 21.0),
                        _rank(1, 29.0, 20.0, 33.3, 20.0),
                        _rank(2, 29.0, 20.0, 30.0, 17.7),
                        _rank(3, 0.0, 20.0, 80.0, 19.0, device="cpu"),
                        _rank(4, 39.0, 20.0, 38.0, 20.0, fits=False),
                        _rank(5, 39.0, 20.0, 45.0, 20.0, fits=False, predicted_fits=False),
                        _rank(6, 28.0, 20.0, 30.0, 20.0, reserved_gib=35.0),
                        _rank(7, 28.0, 20.0, 33.0, 20.0),
                        _rank(8, 29.0, 20.0, 30.0, 20.0, fb=(30.0, 10.0, 10.5, 11.0), compute_here=12.0),
                        _rank(9, 29.0, 20.0, 30.0, 20.0, fb=(30.0, 10.0, 10.5, 11.0), compute_here=13.0),
                        _rank(10, 29.0, 20.0, 30.0, 20.0, fb=(30.0, 10.0, 10.5, 11.0), compute_here=9.0,
                              step_here=12.0),
                        _rank(11, 29.0, 20.0, 30.0, 20.0, fb=(30.0, 10.0, 10.5, 11.0), compute_here=10.6,
                              step_here=9.0)]}
    points = rehearsal_points(report)
    assert [label.split()[1] for label, *_ in points] == ["0", "1", "2", "3", "4", "6", "7", "8", "9", "10", "11"]
    found = {label.split()[1]: (misses(m, p), failure) for label, m, p, failure in points}
    assert found["0"] == ({}, None)
    assert set(found["1"][0]) == {"gpu"} and set(found["2"][0]) == {"host"}
    assert found["3"] == ({}, None)  # GPU memory of a CPU rehearsal not compared
    assert "ran out" in found["4"][1] and "predicted it fits" in found["4"][1]
    assert found["6"] == ({}, None) and set(found["7"][0]) == {"gpu"}
    assert found["8"] == ({}, None) and found["9"][0] == {"step": (10.5, 13.0)}  # 14% and 24% off
    # the step here (10.6 with the optimizer's 0.1) against 12.0: 13% off; against 9.0: 15.1% off, a
    # miss though the forward-backward alone is within 1% of the compute
    assert found["10"] == ({}, None) and found["11"][0] == {"step": (10.6, 9.0)}


def test_the_rehearsal_tables_hold_what_their_files_say():
    """docs/rehearsal.md's tables of rehearsals: each row's figures are those of the result file named in it (rank 0
    in the table of presets, the row's rank in the table of pipeline stages); the step measured is the
    median of steps 2.. of forward-backward plus optimizer step beside the planner's step on the H200,
    or, for a report without that prediction, forward-backward beside the planner's compute there."""
    import statistics

    text = (ROOT / "docs" / "rehearsal.md").read_text()
    rows = [line for line in text.splitlines() if line.startswith("| ") and "`rehearse-" in line]
    assert len(rows) >= 12
    for row in rows:
        name = re.search(r"`(rehearse-[\w.-]+\.json)`", row).group(1)
        report = json.loads((RESULTS / name).read_text())
        cells = [c.strip() for c in row.strip("|").split("|")]
        staged = re.fullmatch(r"(\w+) \(rank (\d+)\)", cells[2])
        r = {x["rank"]: x for x in report["ranks"]}[int(staged.group(2))] if staged else report["ranks"][0]
        assert not staged or r["stage"] == staged.group(1), (name, cells)
        m, p = r["measured"], r["predicted"]
        steps = m["steps"][1:]
        if p.get("step_here_s") is not None:
            measured = statistics.median(s["forward_backward_s"] + s["optimizer_step_s"] for s in steps)
            planned, kinds = p["step_here_s"], (" (step)", " (step)")
        else:
            measured = statistics.median(s["forward_backward_s"] for s in steps)
            planned, kinds = p["compute_here_s"], (" (forward-backward)", " (compute)")
        memory = [f"{p['gpu_total_bytes'] / GIB:.2f} GiB", f"{m['host_peak_rss_bytes'] / GIB:.2f} GiB",
                  f"{p['host_per_rank_bytes'] / GIB:.2f} GiB"]
        if staged:
            expected = [f"{m['gpu_peak_allocated_bytes'] / GIB:.2f} GiB", *memory, f"{measured:.2f} s",
                        f"{planned:.2f} s", f"`{name}` ({report['commit'][:7]})"]
            assert cells[3:10] == expected, (name, cells)
        else:
            expected = [f"{m['gpu_peak_allocated_bytes'] / GIB:.2f} / {m['gpu_peak_reserved_bytes'] / GIB:.2f} GiB "
                        f"(cap {r['gpu_cap_bytes'] / GIB:.2f})", *memory, f"{measured:.2f} s{kinds[0]}",
                        f"{planned:.2f} s{kinds[1]}", f"`{name}` ({report['commit'][:7]})",
                        str(m.get("gpu_alloc_retries"))]
            assert cells[2:10] == expected, (name, cells)
        assert r["fits"] and report["fits"]


def test_declared_rehearsal_exceptions_name_committed_reports_and_say_why():
    for section in ("rehearsal_misses", "rehearsal_unchecked"):
        for name, entry in RUNS.get(section, {}).items():
            assert (RESULTS / name).is_file(), (section, name)
            assert entry["quantities"] and set(entry["quantities"]) <= set(TOLERANCE) and entry["why"], (section, name)
