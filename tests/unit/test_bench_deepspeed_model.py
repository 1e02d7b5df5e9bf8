"""The DeepSpeed peer (benchmarks/deepspeed_peer.py, run as scripts/bench_deepspeed.py) trains what
`angelgpt train` trains: its plain-PyTorch GPT has exactly the parameters,
layouts and initial scale of angelgpt's Megatron GPT, reads the same batches, takes the same loss, the same
AdamW groups and the same LR schedule, so the benchmark's peers train the same model and count the same
FLOPs. Checked on CPU against a real `angelgpt train` run of the tiny preset; DeepSpeed itself only where
it is installed."""

import importlib.util
import math
import os
import subprocess
import sys

import pytest
import torch

from angelgpt.config import parse
from angelgpt.model.flops import num_params
from benchmarks.deepspeed_peer import CONFIGS, GPT, MegatronLR, ds_config, param_groups, train_batches, unsupported
from tests.helpers import ROOT, read_metrics, train_tiny
ITERS = 20
_LAYER = {"input_layernorm": "ln1", "self_attention.linear_qkv": "qkv", "self_attention.linear_proj": "proj",
          "pre_mlp_layernorm": "ln2", "mlp.linear_fc1": "fc1", "mlp.linear_fc2": "fc2"}


def script_name(megatron_name: str) -> str:
    """The script's parameter that holds Megatron GPTModel's `megatron_name` (same shape and layout)."""
    if megatron_name.startswith("embedding.word_embeddings."):
        return "wte.weight"
    if megatron_name.startswith("embedding.position_embeddings."):
        return "wpe.weight"
    if megatron_name.startswith("decoder.final_layernorm."):
        return "ln_f." + megatron_name.rsplit(".", 1)[1]
    _, _, layer, rest = megatron_name.split(".", 3)
    module, leaf = rest.rsplit(".", 1)
    return f"blocks.{layer}.{_LAYER[module]}.{leaf}"


@pytest.fixture(scope="module")
def angelgpt_run(tmp_path_factory):
    """The tiny preset trained by `angelgpt train` on CPU (Megatron's mock data, its schedule)."""
    return train_tiny(tmp_path_factory.mktemp("angelgpt"), "tiny", f"train.train_iters={ITERS}")


@pytest.fixture(scope="module")
def start(megatron_single_rank):
    """The tiny config, angelgpt's Megatron GPT with the weights `angelgpt train` starts from on CPU, and the
    script's GPT holding those weights."""
    from angelgpt.model.gpt import build_gpt

    cfg = parse("tiny", overrides=[f"train.train_iters={ITERS}"])
    torch.manual_seed(cfg.train.seed)  # as the worker seeds before building
    megatron = build_gpt(cfg, on_gpu=False)
    model = GPT(cfg)
    state = {script_name(n): p.detach().clone() for n, p in megatron.named_parameters()}
    state["lm_head.weight"] = state["wte.weight"]  # tied
    model.load_state_dict(state, strict=True)
    return cfg, megatron, model


@pytest.mark.parametrize("name, layers", [("tiny", 2), ("h200-16b", 1), ("h200-16b", 3)])
def test_parameter_count_matches_megatron_gpt(name, layers):
    cfg = parse(name, overrides=[f"model.num_layers={layers}"])
    with torch.device("meta"):
        model = GPT(cfg)
    assert model.lm_head.weight is model.wte.weight  # tied, counted once
    assert sum(p.numel() for p in model.parameters()) == num_params(cfg)


@pytest.mark.subprocess
def test_first_step_loss_gradients_and_norm_equal_angelgpt(start, angelgpt_run):
    """On the first global batch the script reads, the script's model with angelgpt's initial weights gives
    the loss and gradient norm `angelgpt train` logged, and Megatron's gradients parameter by parameter."""
    from angelgpt.train.step import loss_func
    from angelgpt.optimizer.cpu import global_grad_norm

    cfg, megatron, model = start
    megatron.zero_grad(set_to_none=True)
    model.zero_grad(set_to_none=True)
    batches, n = train_batches(cfg, 0, 1, torch.device("cpu")), cfg.num_microbatches(1)
    losses, megatron_losses = [], []
    for _ in range(n):
        b = next(batches)
        loss = model(b["tokens"], b["labels"], b["position_ids"], b["loss_mask"])
        (loss / n).backward()
        losses.append(loss.item())
        reference, _ = loss_func(b["loss_mask"], megatron(b["tokens"], b["position_ids"], None, labels=b["labels"]))
        (reference / n).backward()
        megatron_losses.append(reference.item())
    norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item()
    first = angelgpt_run[0]
    assert sum(losses) / n == pytest.approx(first["lm_loss"], rel=1e-4)
    assert norm == pytest.approx(first["grad_norm"], rel=1e-4)
    assert losses == pytest.approx(megatron_losses, rel=1e-5)
    assert norm == pytest.approx(global_grad_norm(list(megatron.parameters())).item(), rel=1e-5)
    grads = dict(model.named_parameters())
    for name, p in megatron.named_parameters():
        torch.testing.assert_close(grads[script_name(name)].grad, p.grad, rtol=1e-4, atol=1e-7, msg=name)


@pytest.mark.subprocess
def test_twenty_steps_follow_angelgpt(start, angelgpt_run):
    """What the script hands DeepSpeed (model, batches, AdamW groups, MegatronLR), stepped as DeepSpeed steps
    them (each micro batch's loss over the micro batch count, global-norm clipping, AdamW, then the
    scheduler), logs the losses, gradient norms and LRs of `angelgpt train` for 20 steps."""
    from angelgpt.optimizer import clip_coefficient

    cfg, _, start_model = start
    model = GPT(cfg)
    model.load_state_dict(start_model.state_dict())
    o = cfg.optim
    optimizer = torch.optim.AdamW(param_groups(model, o.weight_decay), lr=o.lr, betas=(o.adam_beta1, o.adam_beta2),
                                  eps=o.adam_eps)
    scheduler = MegatronLR(optimizer, cfg)
    assert optimizer.param_groups[0]["lr"] == 0.0  # the warmup's first step, as in Megatron
    batches, n = train_batches(cfg, 0, 1, torch.device("cpu")), cfg.num_microbatches(1)
    for record in angelgpt_run:
        losses = []
        for _ in range(n):
            b = next(batches)
            loss = model(b["tokens"], b["labels"], b["position_ids"], b["loss_mask"])
            (loss / n).backward()
            losses.append(loss.item())
        norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item()
        for p in model.parameters():
            p.grad.mul_(clip_coefficient(norm, o.clip_grad))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        assert sum(losses) / n == pytest.approx(record["lm_loss"], rel=1e-4), record["iteration"]
        assert norm == pytest.approx(record["grad_norm"], rel=1e-4), record["iteration"]
        assert scheduler.get_last_lr()[0] == pytest.approx(record["lr"], rel=1e-9), record["iteration"]
    assert angelgpt_run[-1]["iteration"] == ITERS and angelgpt_run[-1]["lm_loss"] < angelgpt_run[0]["lm_loss"] - 0.5


def test_weight_decay_groups_are_angelgpts(start):
    """Biases and norms take no weight decay; the decayed and undecayed parameters are angelgpt's."""
    from angelgpt.optimizer.cpu import param_groups as angelgpt_groups

    cfg, megatron, model = start
    ours, theirs = param_groups(model, 0.1), angelgpt_groups(megatron, 0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    assert all(n.endswith(".bias") or ".ln" in n or n.startswith("ln") for n in map(names.get, map(id, ours[1]["params"])))
    for mine, reference in zip(ours, theirs):
        assert mine["weight_decay"] == reference["weight_decay"] and mine["wd_mult"] == reference["wd_mult"]
        assert sorted(p.numel() for p in mine["params"]) == sorted(p.numel() for p in reference["params"])


def test_initial_scale_per_tensor_class_is_megatrons(megatron_single_rank):
    """Freshly drawn (not copied) weights have Megatron's std per kind of tensor: embeddings and input
    projections std, output projections std/sqrt(2 L), zero biases, unit norms."""
    from angelgpt.model.gpt import build_gpt

    cfg = parse("tiny", overrides=["model.hidden_size=256", "model.ffn_hidden_size=1024", "model.num_layers=4",
                                     "model.vocab_size=2048"])
    torch.manual_seed(0)
    megatron = dict(build_gpt(cfg, on_gpu=False).named_parameters())
    torch.manual_seed(1)
    model = dict(GPT(cfg).named_parameters())
    kinds = {}
    for name, p in megatron.items():
        kind = script_name(name).split(".", 2)[-1] if name.startswith("decoder.layers") else script_name(name)
        kinds.setdefault(kind, []).append((p.detach(), model[script_name(name)].detach()))
    for kind, pairs in kinds.items():
        theirs = torch.cat([a.flatten() for a, _ in pairs])
        ours = torch.cat([b.flatten() for _, b in pairs])
        assert ours.mean().item() == pytest.approx(theirs.mean().item(), abs=2e-3), kind
        assert ours.std().item() == pytest.approx(theirs.std().item(), rel=0.03, abs=1e-6), kind
    assert megatron["decoder.layers.0.mlp.linear_fc2.weight"].std().item() == pytest.approx(
        cfg.model.init_method_std / math.sqrt(2 * cfg.model.num_layers), rel=0.03)


def test_recompute_keeps_gradients(start):
    cfg, _, start_model = start
    model = GPT(cfg)
    model.load_state_dict(start_model.state_dict())
    b = next(train_batches(cfg, 0, 1, torch.device("cpu")))
    model(b["tokens"], b["labels"]).backward()
    plain = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    model.recompute = True  # full activation recompute gives the same gradients
    model(b["tokens"], b["labels"]).backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, plain[n], rtol=1e-5, atol=1e-7, msg=n)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_deepspeed_configs_carry_batch_adamw_and_placement(name):
    cfg = parse("h200-16b", overrides=["model.num_layers=7", "train.micro_batch_size=4",
                                         "train.global_batch_size=32", "optim.clip_grad=0.5"])
    ds = ds_config(cfg, world=1, on_gpu=True, name=name)
    assert ds["train_micro_batch_size_per_gpu"] * ds["gradient_accumulation_steps"] == ds["train_batch_size"] == 32
    assert ds["gradient_clipping"] == 0.5 and ds["bf16"]["enabled"]
    assert ds["optimizer"]["params"]["betas"] == [cfg.optim.adam_beta1, cfg.optim.adam_beta2]
    zero = ds["zero_optimization"]
    assert zero["stage"] == (2 if name.startswith("zero2") else 3)
    assert zero["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    assert ("offload_param" in zero) == (name == "zero3_offload")
    if name == "zero3_offload":
        assert zero["offload_param"] == {"device": "cpu", "pin_memory": True}


@pytest.mark.parametrize("override, needle", [("model.normalization=RMSNorm", "RMSNorm"), ("model.norm_epsilon=1e-6", "eps"),
                                              ("model.swiglu=true", "GELU MLP"), ("model.add_bias_linear=false", "biased")])
def test_an_architecture_this_model_does_not_build_is_named(override, needle):
    assert unsupported(parse("tiny")) is None
    assert needle in unsupported(parse("tiny", overrides=[override]))


@pytest.mark.subprocess
def test_unknown_configuration_is_one_line():
    proc = subprocess.run([sys.executable, "scripts/bench_deepspeed.py", "--size", "tiny", "deepspeed_config=zero4"],
                          cwd=ROOT, text=True, capture_output=True, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"bench_deepspeed: deepspeed_config is one of {', '.join(CONFIGS)}, got 'zero4'"]


@pytest.mark.subprocess
@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="DeepSpeed is not installed")
def test_deepspeed_zero2_offload_trains_what_angelgpt_trains(tmp_path, angelgpt_run):
    """DeepSpeed itself (ZeRO-2, CPU AdamW, on CPU in fp32; its CPU Adam op builds on first use) logs
    angelgpt's losses, gradient norms and LRs: its loss scaling, clipping and scheduler stepping are
    angelgpt's. Its initial weights are its own draw, so the losses agree within what another seed moves."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    metrics = tmp_path / "ds.jsonl"
    proc = subprocess.run([sys.executable, "scripts/bench_deepspeed.py", "--size", "tiny", "--metrics-file",
                           str(metrics), f"train.train_iters={ITERS}", "deepspeed_config=zero2_offload_opt"],
                          cwd=ROOT, text=True, capture_output=True, timeout=1800,
                          env=dict(os.environ, OMP_NUM_THREADS="1", MASTER_PORT=str(port)))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ours = read_metrics(metrics)
    assert [r["iteration"] for r in ours] == [r["iteration"] for r in angelgpt_run]
    for mine, reference in zip(ours, angelgpt_run):
        assert mine["lr"] == pytest.approx(reference["lr"], rel=1e-9)
        assert mine["lm_loss"] == pytest.approx(reference["lm_loss"], rel=0.02)
    assert ours[-1]["lm_loss"] < ours[0]["lm_loss"] - 0.5
