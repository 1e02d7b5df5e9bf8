"""model.activation_offload: the planner's account of it (the recomputed layers' kept inputs leave the GPU
for pinned host memory, their PCIe time exposed; 'auto' takes it where only it fits), its checks, and the
hooks that move the tensors (angelgpt/model/offload.py) against training without them on CPU."""

import json
from dataclasses import replace

import pytest
import torch

from angelgpt.config import parse
from angelgpt.planner import machine_from, plan_for, resolve_config, resolved_line
from angelgpt.planner.plan import activation_bytes, offloaded_activation_bytes, plan_zero_cache
from tests.helpers import check_one_line_error, one_quick, run_cli, train_tiny

NODE = machine_from("a100-40gx8", host_mem_gib=1000.0)  # the reference node: 8x A100-40G, 1 TB host
# the 55 shape at TP 2 with sequence parallelism, its placement pinned so that only the offload changes
PINNED = ["parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=true", "model.recompute=full",
          "zero_cache.offload_params=true", "zero_cache.accumulate_in_store=true"]


def _55(*overrides):
    return parse("55", overrides=[*PINNED, *overrides])


def test_the_offload_moves_exactly_the_recomputed_layers_inputs_from_gpu_to_host():
    """68 layers' inputs of 2*s*b*h/TP bytes each leave every GPU's activations and appear in its pinned
    host memory (the node's total: eight GPUs' worth); nothing else moves; their PCIe time, down in
    forward and up in backward for each micro batch, is added to the step."""
    off, on = _55("model.activation_offload=none"), _55("model.activation_offload=checkpoints")
    m = on.model
    moved = m.num_layers * 2 * m.seq_length * on.train.micro_batch_size * m.hidden_size // 2
    assert offloaded_activation_bytes(on) == moved and offloaded_activation_bytes(off) == 0
    assert activation_bytes(off) - activation_bytes(on) == moved
    assert activation_bytes(on, True, False) == activation_bytes(off) and activation_bytes(off, True, True) == \
        activation_bytes(on)
    p_off, p_on = plan_zero_cache(off, NODE, 8), plan_zero_cache(on, NODE, 8)
    assert (p_off.activation_offload, p_on.activation_offload) == ("none", "checkpoints")
    assert p_off.gpu_bytes["activations"] - p_on.gpu_bytes["activations"] == moved
    assert {k: v for k, v in p_on.gpu_bytes.items() if k != "activations"} == \
        {k: v for k, v in p_off.gpu_bytes.items() if k != "activations"}
    assert p_on.host_bytes == {**p_off.host_bytes, "offloaded_activations": moved}
    assert p_on.host_total - p_off.host_total == 8 * moved
    mb = on.num_microbatches(on.data_parallel_size(8))
    assert p_on.step_s["activation_offload"] == pytest.approx(mb * 2 * moved / (NODE.pcie_gbs * 1e9), abs=1e-4)
    assert p_on.step_time_s > p_off.step_time_s
    # only the recomputed layers' inputs: the first 10 of 68, or none without recompute
    ten = _55("model.activation_offload=checkpoints", "model.recompute_num_layers=10")
    assert offloaded_activation_bytes(ten) == 10 * moved // 68
    assert offloaded_activation_bytes(replace(on, model=replace(m, recompute="none"))) == 0


@pytest.mark.slow  # plans of the 55 shape
def test_auto_offloads_where_only_that_fits_and_not_where_keeping_them_fits():
    """The 55 shape at TP 2 with sequence parallelism on the reference node fits only with the inputs
    offloaded: 'auto' takes it, and resolving says so; at TP 4 it fits with them on the GPU, which is
    faster, and 'auto' keeps them there."""
    auto = _55("model.activation_offload=auto")
    p = plan_for(auto, NODE, 8)
    assert p.fits and p.activation_offload == "checkpoints", p
    assert not plan_for(_55("model.activation_offload=none"), NODE, 8).fits
    out, plan = resolve_config(auto, NODE, 8, 1, on_gpu=True)
    assert out.model.activation_offload == "checkpoints" and plan == p
    assert "model.activation_offload=checkpoints" in resolved_line(auto, out)
    assert resolve_config(out, NODE, 8, 1, on_gpu=True) == (out, plan)  # idempotent
    wider = _55("model.activation_offload=auto", "parallel.tensor_model_parallel_size=4")
    kept = plan_for(wider, NODE, 8)
    assert kept.fits and kept.activation_offload == "none", kept
    # with recompute 'auto' the choice is made together with it; without recompute nothing is offloaded
    both = plan_for(_55("model.activation_offload=auto", "model.recompute=auto"), NODE, 8)
    assert both.fits and both.recompute == "full" and both.activation_offload == "checkpoints", both
    assert plan_for(_55("model.activation_offload=auto", "model.recompute=none"), NODE, 8).activation_offload == "none"


def test_on_cpu_auto_is_none_and_checkpoints_stays():
    cpu = machine_from("a100-40gx8")
    out, _ = resolve_config(parse("tiny"), cpu, 1, 1, on_gpu=False)
    assert out.model.activation_offload == "none"
    kept, _ = resolve_config(parse("tiny", overrides=["model.activation_offload=checkpoints"]), cpu, 1, 1, False)
    assert kept.model.activation_offload == "checkpoints"  # the CPU stand-in: every saved tensor


@pytest.mark.subprocess
def test_checkpoints_without_full_recompute_on_gpu_is_one_line_and_bad_values_too():
    check_one_line_error(run_cli("plan", "--size", "tiny", "model.activation_offload=checkpoints"),
                         "model.activation_offload 'checkpoints' moves the inputs that recompute keeps: it needs "
                         "model.recompute 'full', got 'none'")
    check_one_line_error(run_cli("plan", "--size", "tiny", "model.activation_offload=all"),
                         "model.activation_offload must be 'none', 'checkpoints' or 'auto', got 'all'")
    proc = run_cli("plan", "--size", "tiny", "model.activation_offload=checkpoints", "model.recompute=full", "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    acts = report["activations_bytes"]
    assert acts["with_recompute"] - acts["with_recompute_offloaded"] == offloaded_activation_bytes(
        parse("tiny", overrides=["model.activation_offload=checkpoints", "model.recompute=full"]))
    assert report["plans"]["zero_cache"]["activation_offload"] == "checkpoints"


# The hooks, in one process on CPU with Megatron's own recompute: its CheckpointFunction saves the CUDA RNG
# state, so here (and only here) the RNG-state functions it calls are CPU-only stand-ins.



@pytest.fixture
def cpu_recompute(monkeypatch, megatron_single_rank):
    from megatron.core.tensor_parallel import random as tp_random

    monkeypatch.setattr(tp_random, "_get_all_rng_states", lambda: (torch.get_rng_state(), None, None))
    monkeypatch.setattr(tp_random, "_set_all_rng_states", lambda cpu, cuda, tracker: torch.set_rng_state(cpu))


def _grads_after(model, cfg, mode):
    from angelgpt.model.offload import offloading

    torch.manual_seed(0)
    s = cfg.model.seq_length
    tokens = torch.randint(0, cfg.model.vocab_size, (2, s))
    model.zero_grad()
    hooks = offloading(model, mode)
    with hooks:
        loss = model(tokens, torch.arange(s).expand(2, -1), None, labels=tokens).float().mean()
    loss.backward()
    return loss.item(), [p.grad.clone() for p in model.parameters()], hooks


@pytest.mark.parametrize("k", one_quick(2, [None, 2]))
def test_the_hooks_move_exactly_the_inputs_that_recompute_keeps_and_change_nothing(cpu_recompute, k):
    """With every layer (or the first k) recomputing, 'checkpoints' moves one tensor per recomputed
    layer, its s*b*h input, and the loss and every gradient are bitwise those without offload; 'everything'
    (the CPU stand-in) moves every saved tensor, the same."""
    from angelgpt.model.gpt import build_gpt

    cfg = parse("tiny", overrides=["model.num_layers=3", "model.recompute=full"]
                  + ([f"model.recompute_num_layers={k}"] if k else []))
    model = build_gpt(cfg, on_gpu=False)
    loss, grads, _ = _grads_after(model, cfg, None)
    sbh = cfg.model.seq_length * 2 * cfg.model.hidden_size
    for mode, moved in (("checkpoints", k or 3), ("everything", None)):
        loss_off, grads_off, hooks = _grads_after(model, cfg, mode)
        assert loss_off == loss and all(torch.equal(a, b) for a, b in zip(grads, grads_off)), mode
        if moved is not None:
            assert (hooks.moved, hooks.moved_bytes) == (moved, moved * sbh * 4), mode  # fp32 on CPU
        else:
            assert hooks.moved > 3 * cfg.model.num_layers
        assert not hooks._handles and not hooks._noted  # the layer hooks are gone with the context


def test_forward_step_offloads_what_its_mode_says(monkeypatch):
    from angelgpt.model import offload
    from angelgpt.train.step import forward_step

    assert offload.offload_mode("checkpoints", True) == "checkpoints"
    assert offload.offload_mode("checkpoints", False) == "everything"
    assert offload.offload_mode("none", True) is None and offload.offload_mode("auto", False) is None
    layer = torch.nn.Linear(4, 4)

    def model(tokens, position_ids, mask, labels):
        return layer(tokens).sum(-1)

    batch = {"tokens": torch.randn(2, 4), "position_ids": None, "labels": None, "loss_mask": torch.ones(2)}
    packed = []
    monkeypatch.setattr(offload.ActivationOffload, "_selected", lambda self, t: packed.append(t.shape) or True)
    output, finish = forward_step(iter([batch]), model, offload="everything")
    output.sum().backward()
    assert packed and layer.weight.grad is not None
    packed.clear()
    forward_step(iter([batch]), model)
    assert packed == []


@pytest.mark.parametrize("extra", [[], ["--nproc-per-node", "2", "parallel.pipeline_model_parallel_size=2",
                                        "optim.optimizer=zero_cache", "zero_cache.prefetch_cache_sub_group_rate=0.5"]])
@pytest.mark.subprocess
def test_training_with_the_offload_hooks_equals_training_without(tmp_path, extra):
    """Through the CLI on CPU (where no layer recomputes, so 'checkpoints' runs its hooks over every tensor
    the forward saves): losses and gradient norms over 4 steps equal those without (the default 'auto',
    resolved to none on CPU), on one rank and on a 2-stage pipeline with ZeRO-Cache."""
    nproc = 2 if extra else 1
    overrides = [w for w in extra if "=" in w]
    base = ["train.train_iters=4", *overrides]
    plain, out = train_tiny(tmp_path, "plain", *base, nproc=nproc, with_output=True)
    assert "model.activation_offload=none" in out
    offloaded = train_tiny(tmp_path, "offloaded", *base, "model.activation_offload=checkpoints", nproc=nproc)
    assert [r["lm_loss"] for r in plain] == [r["lm_loss"] for r in offloaded]
    assert [r["grad_norm"] for r in plain] == [r["grad_norm"] for r in offloaded]
    assert len(plain) == 4
