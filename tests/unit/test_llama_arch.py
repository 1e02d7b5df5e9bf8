"""The model section's architecture options (normalization, swiglu, add_bias_linear, RoPE's rotary_base and
rotary_percent, num_query_groups, untied output) on real Megatron models built on the CPU: each builds the
parameters num_params and the planner's layout count, does what its name says, and RoPE runs on the CPU.
(Training with them at TP 2, PP 2 and with ZeRO-Cache: tests/distributed/test_llama_cpu.py.)"""

import math

import pytest
import torch
import torch.nn.functional as F

from angelgpt.config import ConfigError, parse
from angelgpt.model.flops import flops_per_iteration, num_params
from angelgpt.planner.layout import rank_params

OPTIONS = {
    "rmsnorm": ["model.normalization=RMSNorm", "model.norm_epsilon=1e-6"],
    "swiglu": ["model.swiglu=true"],
    "no-bias": ["model.add_bias_linear=false"],
    "qkv-bias": ["model.add_bias_linear=false", "model.add_qkv_bias=true"],
    "rope": ["model.position_embedding_type=rope", "model.rotary_base=500000", "model.rotary_percent=0.5"],
    "gqa": ["model.num_query_groups=2"],
    "untied": ["model.untie_embeddings_and_output_weights=true"],
    "gqa-head-size": ["model.num_query_groups=1", "model.kv_channels=8", "model.swiglu=true",
                      "model.ffn_hidden_size=96"],
}


def build(name, *overrides, seed=1234):
    from angelgpt.model.gpt import build_gpt

    cfg = parse(name, overrides=list(overrides))
    torch.manual_seed(seed)
    return cfg, build_gpt(cfg, on_gpu=False)


@pytest.mark.parametrize("case", [*OPTIONS, "llama-tiny"])
def test_each_option_builds_the_parameters_that_num_params_and_the_planner_count(megatron_single_rank, case):
    cfg, model = build("llama-tiny") if case == "llama-tiny" else build("tiny", *OPTIONS[case])
    built = {n: p.numel() for n, p in model.named_parameters()}
    assert sum(built.values()) == num_params(cfg)
    assert built == {p.name: p.numel for p in rank_params(cfg)}  # names and sizes, biases and all
    norms = [m for m in model.modules() if isinstance(m, (torch.nn.LayerNorm, torch.nn.RMSNorm))]
    assert len(norms) == 2 * cfg.model.num_layers + 1
    kind = torch.nn.RMSNorm if cfg.model.normalization == "RMSNorm" else torch.nn.LayerNorm
    assert all(type(m) is kind and m.eps == cfg.model.norm_epsilon for m in norms)


def test_swiglu_is_silu_of_the_gate_times_the_up_projection(megatron_single_rank):
    cfg, model = build("tiny", "model.swiglu=true", "model.add_bias_linear=false")
    mlp = model.decoder.layers[0].mlp
    f = cfg.model.ffn_hidden_size
    assert f == int(8 * 64 / 3 / 64) * 64 == 128  # Megatron-LM's default width with swiglu
    x = torch.randn(5, 2, cfg.model.hidden_size)
    gate, up = mlp.linear_fc1.weight[:f], mlp.linear_fc1.weight[f:]
    expected = (F.silu(x @ gate.T) * (x @ up.T)) @ mlp.linear_fc2.weight.T
    out, bias = mlp(x)
    assert bias is None
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)


def test_rope_runs_on_the_cpu_and_rotates_by_position(megatron_single_rank):
    """Same weights (RoPE has none), another base or percent: the first position, which only attends to
    itself and is rotated by 0, gives the same logits; later positions differ."""
    tokens = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(64).expand(2, 64)

    def logits(*overrides):
        cfg, model = build("llama-tiny", *overrides)
        with torch.no_grad():
            return model(tokens, positions, None), model.state_dict()

    base, weights = logits()
    for overrides in (["model.rotary_base=500000"], ["model.rotary_percent=0.5"]):
        other, other_weights = logits(*overrides)
        assert all(torch.equal(weights[k], other_weights[k]) for k in weights if not k.endswith("_extra_state"))
        torch.testing.assert_close(other[:, 0], base[:, 0])
        assert (other[:, 1:] - base[:, 1:]).abs().max() > 1e-3, overrides
    again, _ = logits()
    assert torch.equal(again, base)


@pytest.mark.parametrize("overrides, needle", [
    (["model.normalization=BatchNorm"], "model.normalization must be 'LayerNorm' or 'RMSNorm', got 'BatchNorm'"),
    (["model.norm_epsilon=0"], "model.norm_epsilon must be > 0"),
    (["model.rotary_base=0"], "model.rotary_base must be > 0"),
    (["model.rotary_percent=1.5"], r"model.rotary_percent must be in \(0, 1\], got 1.5"),
    (["model.rotary_percent=0.1"], "must leave an even number of rotated channels > 0, got 1"),
    (["model.swiglu=true", "model.hidden_size=16", "model.num_attention_heads=4"], "model.ffn_hidden_size must be > 0"),
])
def test_architecture_option_checks(overrides, needle):
    with pytest.raises(ConfigError, match=needle):
        parse("tiny", overrides=overrides)


def test_the_launcher_accepts_rope_on_cpu():
    """A CPU job with RoPE passes the launcher's device checks (its dry run prints the config launched)."""
    from tests.helpers import run_cli_in_process

    proc = run_cli_in_process("train", "--size", "llama-tiny", "--device", "cpu", "--dry-run")
    assert proc.returncode == 0, proc.stderr
    assert "position_embedding_type: rope" in proc.stdout


@pytest.mark.parametrize("name", ["llama3-8b", "h200-llama-29b", "125m"])
def test_flops_are_megatron_lm_s_with_the_causal_half_of_attention(name):
    """Megatron-LM's num_floating_point_operations (training.py, dense GPT): 12*B*s*L*h^2*((1 + g/n + s/h)*q/h
    + f/h*(3/2 with swiglu) + V/(2*L*h)); it counts the whole s x s attention square where angelgpt counts
    the causal half, 6*B*s*L*s*q less."""
    cfg = parse(name)
    m = cfg.model
    B, s, L, h, f = cfg.train.global_batch_size, m.seq_length, m.num_layers, m.hidden_size, m.ffn_hidden_size
    n, g, q, V = m.num_attention_heads, m.num_query_groups, m.num_attention_heads * m.kv_channels, cfg.padded_vocab_size()
    glu = 1.5 if m.swiglu else 1.0
    megatron = 12 * B * s * L * h * h * ((1 + g / n + s / h) * q / h + f / h * glu + V / (2 * L * h))
    assert math.isclose(flops_per_iteration(cfg), megatron - 6 * B * s * L * s * q, rel_tol=1e-12)


def test_the_llama3_8b_preset_is_llama_3_8b():
    cfg = parse("llama3-8b")
    m = cfg.model
    assert (m.num_layers, m.hidden_size, m.ffn_hidden_size, m.num_attention_heads, m.num_query_groups,
            m.vocab_size, m.rotary_base, m.norm_epsilon) == (32, 4096, 14336, 32, 8, 128256, 500000, 1e-5)
    assert m.swiglu and m.normalization == "RMSNorm" and not m.add_bias_linear
    assert m.untie_embeddings_and_output_weights and m.position_embedding_type == "rope"
    assert num_params(cfg) == 8_030_261_248  # Llama-3-8B's published count


@pytest.mark.slow  # plans 29b and 140 layers of the 8b shape
def test_the_h200_llama_preset_is_the_8b_layer_and_fits_one_h200_by_the_planner():
    from dataclasses import replace

    from angelgpt.planner import MACHINES, auto_plan

    cfg, llama = parse("h200-llama-29b"), parse("llama3-8b")
    shape = {k: v for k, v in vars(llama.model).items() if k not in ("num_layers", "recompute")}
    assert replace(cfg.model, **shape) == cfg.model
    assert auto_plan(cfg, MACHINES["h200"]).fits
    assert not auto_plan(parse("h200-llama-29b", overrides=["model.num_layers=140"]), MACHINES["h200"]).fits


def test_the_planner_counts_what_swiglu_s_mlp_saves_for_backward(megatron_single_rank):
    """What autograd keeps of one MLP forward (distinct storages, weights aside), SwiGLU against GELU at
    the same width: linear_fc1's 2*ffn output, the up half plus megatron-core's glu_linear_offset,
    silu(gate) and the product beside GELU's two ffn-wide tensors, 3*ffn elements a token more, as the
    planner's activation_bytes counts them (in bf16, 2 bytes each)."""
    from angelgpt.planner.plan import activation_bytes

    def saved_elements(cfg, model):
        storages = {}
        weights = {p.untyped_storage().data_ptr() for p in model.parameters()}

        def pack(t):
            if t.untyped_storage().data_ptr() not in weights:
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes() // t.element_size()
            return t

        x = torch.randn(cfg.model.seq_length, cfg.train.micro_batch_size, cfg.model.hidden_size, requires_grad=True)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model.decoder.layers[0].mlp(x)
        return sum(storages.values())

    gelu, swiglu = (build("tiny", "model.ffn_hidden_size=128", f"model.swiglu={on}") for on in ("false", "true"))
    measured = saved_elements(*swiglu) - saved_elements(*gelu)
    cfg = gelu[0]
    s, b, f = cfg.model.seq_length, cfg.train.micro_batch_size, cfg.model.ffn_hidden_size
    assert measured == 3 * f * s * b
    planned = activation_bytes(swiglu[0], False) - activation_bytes(gelu[0], False)
    assert planned == cfg.model.num_layers * 2 * measured
