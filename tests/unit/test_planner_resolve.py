"""The planner's machine catalogue (every figure sourced, machines described from what is read) and its
one resolution of 'auto' settings into a concrete config (no GPU needed: both are pure)."""

import json
import subprocess
import sys
from dataclasses import fields, is_dataclass, replace

import pytest

from angelgpt.config import ConfigError, parse
from angelgpt.planner import (GIB, MACHINES, Machine, beside_store_bytes, describe, machine_from, plan_for,
                              read_this_machine, resolve_config, resolved_line)
from angelgpt.planner.machines import FIGURES, RATES
from angelgpt.planner.plan import CUDA_CONTEXT, WORKSPACE, activation_bytes

H200 = MACHINES["h200"]


def _autos(cfg):
    """Every 'section.key' whose value is still 'auto'."""
    return [f"{s.name}.{f.name}" for s in fields(cfg) if is_dataclass(getattr(cfg, s.name))
            for f in fields(getattr(cfg, s.name)) if getattr(getattr(cfg, s.name), f.name) == "auto"]


def test_every_figure_of_every_catalogue_machine_says_where_it_came_from():
    for name, m in MACHINES.items():
        assert set(m.sources) == set(FIGURES), name
        for figure in FIGURES:
            assert m.sources[figure].startswith(("measured: ", "assumed: ")), (name, figure, m.sources[figure])
    # only the one-H200 test machine was measured; the 8-GPU nodes' rates were not
    assert all(MACHINES["h200"].sources[k].startswith("measured") for k in RATES if k != "net_gbps")
    for name in ("h200x8", "h100x8", "a100-80gx8", "a100-40gx8"):
        assert all(MACHINES[name].sources[k].startswith("assumed") for k in RATES), name


def test_machines_are_built_with_keywords_and_survive_json():
    with pytest.raises(TypeError):
        Machine("x", "H200", 1, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0)
    read = describe("NVIDIA H200", int(139.8 * GIB), 1, 120 * GIB, 0)
    for m in [*MACHINES.values(), read, machine_from("a100-40gx8", host_mem_gib=1000.0)]:
        text = m.to_json()
        assert json.loads(text)["sources"] == m.sources
        assert Machine(**json.loads(text)) == m


def test_a_figure_given_on_the_command_line_says_so():
    m = machine_from("a100-40gx8", host_mem_gib=1000.0, gpu_tflops=None)
    assert m.host_mem_gib == 1000.0 and m.sources["host_mem_gib"].startswith("given: ")
    assert m.sources["gpu_tflops"] == MACHINES["a100-40gx8"].sources["gpu_tflops"]


def test_an_h200_is_described_with_the_h200_figures_and_the_memory_read():
    m = describe("NVIDIA H200", 150_000_000_000, 1, 100 * GIB, 10 * GIB)
    assert all(getattr(m, k) == getattr(H200, k) for k in RATES)
    assert m.gpu_mem_gib == 150_000_000_000 / GIB and m.host_mem_gib == 100.0 and m.nvme_gib == 10.0
    assert m.sources["pcie_gbs"].startswith("measured: ") and "h200" in m.sources["pcie_gbs"]
    assert all(m.sources[k].startswith("measured: read on this machine") for k in set(FIGURES) - set(RATES))
    # eight of them: the 8-GPU row's (assumed) figures; two: the one-GPU row's, marked assumed for this node
    assert describe("NVIDIA H200", int(139.8 * GIB), 8, 0, 0).cpu_adam_gparams == MACHINES["h200x8"].cpu_adam_gparams
    two = describe("NVIDIA H200 NVL", int(139.8 * GIB), 2, 0, 0)
    assert two.pcie_gbs == H200.pcie_gbs and all(two.sources[k].startswith("assumed: ") for k in RATES)


def test_a100s_are_told_apart_by_memory_and_names_match_whole_words():
    for name, gib, row in (("NVIDIA A100-SXM4-40GB", 39.4, "a100-40gx8"), ("NVIDIA A100 80GB PCIe", 79.2, "a100-80gx8"),
                           ("NVIDIA H100 80GB HBM3", 79.6, "h100x8")):
        m = describe(name, int(gib * GIB), 8, 0, 0)
        assert all(getattr(m, k) == getattr(MACHINES[row], k) for k in RATES), name
        assert row in m.sources["gpu_tflops"], (name, m.sources["gpu_tflops"])
    assert describe("NVIDIA GH200 480GB", 95 * GIB, 1, 0, 0).sources["gpu_tflops"] == \
        describe("Some Future GPU", 95 * GIB, 1, 0, 0).sources["gpu_tflops"]  # GH200 is not in the catalogue


def test_a_gpu_the_catalogue_does_not_know_gets_rates_marked_assumed_not_the_h200s():
    m = describe("Some Future GPU", 80 * GIB, 1, 200 * GIB, 0)
    assert m.gpu_mem_gib == 80.0 and m.host_mem_gib == 200.0
    assert (m.pcie_gbs, m.gpu_tflops, m.nvme_gbs) != (H200.pcie_gbs, H200.gpu_tflops, H200.nvme_gbs)
    assert m.pcie_gbs != H200.pcie_gbs and m.gpu_tflops != H200.gpu_tflops
    assert all(m.sources[k].startswith("assumed: ") for k in RATES), m.sources


def test_reading_a_machine_without_cuda_gives_no_gpu_memory(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    zc = parse("tiny").zero_cache
    m = read_this_machine(replace(zc, host_max_gib=4.0), 2)
    assert m.gpu_mem_gib == 0 and m.gpus_per_node == 2 and m.nvme_gib == 0
    assert m.host_mem_gib == pytest.approx(2 * (4.0 + 1.8))  # per GPU: what the store may take, and the process
    assert Machine(**json.loads(m.to_json())) == m


def test_on_cpu_every_auto_becomes_a_value():
    cfg = parse("tiny", overrides=["optim.optimizer=zero_cache", "model.recompute=auto",
                                     "zero_cache.prefetch_cache_sub_group_rate=auto"])
    assert len(_autos(cfg)) >= 7, _autos(cfg)
    out, plan = resolve_config(cfg, describe("no CUDA GPU", 0, 1, 8 * GIB, 0), 1, 1, on_gpu=False)
    assert plan is None and _autos(out) == []
    assert out.train.device == "cpu" and out.model.transformer_impl == "local"
    assert (out.model.recompute, out.model.recompute_num_layers) == ("none", None)
    zc = out.zero_cache
    assert (zc.prefetch_cache_sub_group_rate, zc.offload_params, zc.device_update_fraction,
            zc.accumulate_in_store) == (1.0, False, 0.0, False)
    assert zc.cpu_adam in ("native", "torch")
    assert resolve_config(out, H200, 1, 1, on_gpu=False) == (out, None)  # idempotent
    line = resolved_line(cfg, out)
    assert line.startswith("resolved: ") and "model.recompute=none" in line and "train.device=cpu" in line
    assert "zero_cache.prefetch_cache_sub_group_rate=1.0" in line and "zero_cache.accumulate_in_store=false" in line
    assert resolved_line(out, out) == ""


@pytest.fixture(scope="module")
def h200_19_layers():
    """19 layers of the 55 shape at global batch 32 on one H200, recompute auto: the planner keeps the
    activations of the last few layers and adds the micro batches up in the store (in bf16, as the runs
    measured there did: in fp32 their sums take 2 more bytes per parameter)."""
    cfg = parse("h200-16b", overrides=["model.num_layers=19", "model.recompute=auto", "train.micro_batch_size=2",
                                         "optim.accumulate_grads_in_fp32=false", "optim.store_param_remainders=false",
                                         "train.global_batch_size=32", "zero_cache.prefetch_cache_sub_group_rate=auto",
                                         "zero_cache.cpu_adam=native"])
    return cfg, plan_for(cfg, H200), resolve_config(cfg, H200, 1, 1, on_gpu=True)


@pytest.mark.slow  # its fixture plans 19 layers of the 55 shape twice
def test_on_the_h200_every_auto_becomes_the_plans_choice(h200_19_layers):
    cfg, planned, (out, plan) = h200_19_layers
    assert _autos(out) == [] and out.train.device == "cuda"
    assert planned.fits and planned.recompute == "full" and 0 < planned.recompute_num_layers < 19
    assert (out.model.recompute, out.model.recompute_num_layers) == (planned.recompute, planned.recompute_num_layers)
    zc = out.zero_cache
    assert zc.prefetch_cache_sub_group_rate == planned.rate
    assert zc.offload_params is planned.offload_params and zc.accumulate_in_store is True
    assert zc.device_update_fraction == planned.device_update_fraction
    assert plan == planned  # the plan of the resolved config is the plan that chose it
    assert resolve_config(out, H200, 1, 1, on_gpu=True) == (out, plan)  # idempotent
    line = resolved_line(cfg, out)
    assert f"model.recompute=full, model.recompute_num_layers={planned.recompute_num_layers}" in line, line
    assert f"zero_cache.prefetch_cache_sub_group_rate={planned.rate}" in line, line
    assert "zero_cache.cpu_adam" not in line  # it was not 'auto'
    assert plan.gpu_bytes["activations"] + plan.gpu_bytes["workspace"] - CUDA_CONTEXT == beside_store_bytes(out)
    assert beside_store_bytes(out) == activation_bytes(out) + WORKSPACE


def test_other_optimizers_get_the_plans_recompute_and_zero_cache_settings_that_are_values():
    cfg = parse("h200-16b", overrides=["model.num_layers=7", "model.recompute=auto", "train.micro_batch_size=1",
                                         "train.global_batch_size=32", "optim.optimizer=megatron"])
    out, plan = resolve_config(cfg, H200, 1, 1, on_gpu=True)
    assert _autos(out) == [] and plan == plan_for(cfg, H200) and plan.fits
    assert out.model.recompute == plan.recompute == "none"
    zc = out.zero_cache
    assert (zc.prefetch_cache_sub_group_rate, zc.offload_params, zc.device_update_fraction,
            zc.accumulate_in_store) == (1.0, False, 0.0, False)


def test_what_is_found_on_the_machine_decides_the_kernel(monkeypatch):
    cfg = parse("tiny", overrides=["optim.optimizer=zero_cache"])
    cpu = describe("no CUDA GPU", 0, 1, 8 * GIB, 0)
    monkeypatch.setenv("CC", "/nonexistent/angelgpt-cc")
    assert resolve_config(cfg, cpu, 1, 1, False)[0].zero_cache.cpu_adam == "torch"
    monkeypatch.setenv("CC", sys.executable)  # found: the kernel would be built with it
    assert resolve_config(cfg, cpu, 1, 1, False)[0].zero_cache.cpu_adam == "native"


def test_transformer_impl_auto_is_the_tested_local_spec_even_where_transformer_engine_is_installed(monkeypatch):
    import types

    monkeypatch.setitem(sys.modules, "transformer_engine", types.ModuleType("transformer_engine"))
    cfg = parse("tiny")
    assert cfg.model.transformer_impl == "auto"
    cpu = describe("no CUDA GPU", 0, 1, 8 * GIB, 0)
    assert resolve_config(cfg, cpu, 1, 1, False)[0].model.transformer_impl == "local"
    assert resolve_config(cfg, H200, 1, 1, True)[0].model.transformer_impl == "local"
    opted_in = parse("tiny", overrides=["model.transformer_impl=transformer_engine"])
    assert resolve_config(opted_in, H200, 1, 1, True)[0].model.transformer_impl == "transformer_engine"


def test_a_concrete_device_must_agree_with_where_it_is_resolved_for():
    with pytest.raises(ConfigError, match="train.device is 'cpu'"):
        resolve_config(parse("tiny", overrides=["train.device=cpu"]), H200, 1, 1, on_gpu=True)


@pytest.mark.subprocess
def test_the_planner_imports_without_torch():
    code = ("import sys, angelgpt.planner, angelgpt.planner.resolve, angelgpt.planner.report; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
