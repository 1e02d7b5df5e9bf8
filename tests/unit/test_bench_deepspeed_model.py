"""The DeepSpeed peer's plain-PyTorch GPT has exactly the parameters of angelgpt's Megatron GPT (whose
count test_presets checks against a built GPTModel) and Megatron's initial scale, so the benchmark's
peers train the same model and count the same FLOPs."""

import math

import pytest
import torch

from angelgpt.config import resolve
from angelgpt.model.flops import num_params
from tests.helpers import load_script

_SCRIPT = load_script("bench_deepspeed")
GPT, ds_config = _SCRIPT["GPT"], _SCRIPT["ds_config"]


@pytest.mark.parametrize("name, layers", [("tiny", 2), ("h200-16b", 1), ("h200-16b", 3)])
def test_parameter_count_matches_megatron_gpt(name, layers):
    cfg = resolve(name, overrides=[f"model.num_layers={layers}"])
    with torch.device("meta"):
        model = GPT(cfg)
    assert model.lm_head.weight is model.wte.weight  # tied, counted once
    assert sum(p.numel() for p in model.parameters()) == num_params(cfg)


def test_initial_loss_is_uniform_over_vocabulary_and_recompute_keeps_gradients():
    cfg = resolve("tiny", overrides=["model.num_layers=3"])
    torch.manual_seed(0)
    model = GPT(cfg)
    tokens = torch.randint(0, cfg.model.vocab_size, (4, cfg.model.seq_length + 1))
    loss = model(tokens[:, :-1], tokens[:, 1:])
    # Megatron's init (std 0.02, scaled output layers) predicts near-uniformly at step 0
    assert abs(loss.item() - math.log(cfg.padded_vocab_size())) < 0.1
    loss.backward()
    plain = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    model.recompute = True  # full activation recompute gives the same gradients
    model(tokens[:, :-1], tokens[:, 1:]).backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, plain[n], rtol=1e-5, atol=1e-7, msg=n)


def test_deepspeed_config_carries_batch_and_adamw_settings():
    cfg = resolve("h200-16b", overrides=["model.num_layers=7", "train.micro_batch_size=4",
                                         "train.global_batch_size=32", "optim.clip_grad=0.5"])
    ds = ds_config(cfg, world=1, on_gpu=True)
    assert ds["train_micro_batch_size_per_gpu"] * ds["gradient_accumulation_steps"] == ds["train_batch_size"] == 32
    assert ds["gradient_clipping"] == 0.5
    assert ds["optimizer"]["params"]["betas"] == [cfg.optim.adam_beta1, cfg.optim.adam_beta2]
    zero = ds["zero_optimization"]
    assert zero["stage"] == 3 and zero["offload_param"]["device"] == zero["offload_optimizer"]["device"] == "cpu"
