"""Presets resolve by name; the 28 and 55 presets carry the reference shapes and fit the reference node
by the planner; params is exact."""

import json

import pytest
import torch

from angelgpt.config import preset_names, parse
from angelgpt.model.flops import format_params, num_params
from tests.helpers import ROOT, run_cli

SEED = {  # the reference shapes, micro batches, sequence and rates; the parallel layout is the preset's choice
    "28": dict(num_layers=26, hidden_size=8192, num_attention_heads=128, ffn_hidden_size=32768, kv_channels=128,
               seq_length=2048, micro_batch_size=38, rate=0.0, billions=28.35),
    "55": dict(num_layers=68, hidden_size=8192, num_attention_heads=64, ffn_hidden_size=32768, kv_channels=128,
               seq_length=2048, micro_batch_size=10, rate=0.1, billions=55.2),
}


def built_params(cfg, layers):
    """Parameter count of a real Megatron GPTModel at cfg's width with `layers` layers (meta tensors)."""
    from megatron.core import parallel_state

    from angelgpt.model.gpt import build_gpt

    small = parse(cfg.name, overrides=[f"model.num_layers={layers}"])
    with torch.device("meta"):
        model = build_gpt(small, on_gpu=False, perform_initialization=False)
    assert parallel_state.model_parallel_is_initialized()
    return sum(p.numel() for p in model.parameters())



@pytest.mark.subprocess
@pytest.mark.parametrize("name", ["28", "55"])
def test_seed_presets_show_json(name):
    proc = run_cli("presets", "show", name, "--json")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    seed = SEED[name]
    model = data["config"]["model"]
    for key in ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "kv_channels", "seq_length"):
        assert model[key] == seed[key], key
    assert data["config"]["train"]["micro_batch_size"] == seed["micro_batch_size"]
    assert data["config"]["zero_cache"]["prefetch_cache_sub_group_rate"] == seed["rate"]
    multiple = 128 * data["config"]["parallel"]["tensor_model_parallel_size"]  # Megatron pads to 128 x TP
    assert data["padded_vocab_size"] == -(-50257 // multiple) * multiple
    assert abs(data["params"] / 1e9 - seed["billions"]) < 0.01


@pytest.mark.subprocess
@pytest.mark.parametrize("name", ["28", "55"])
def test_reference_presets_fit_the_reference_node_by_the_planner(name):
    """`angelgpt plan --size 28|55 --machine a100-40gx8 --host-mem 1000 --json`: ZeRO-Cache fits with the
    preset as shipped (its TP, sequence parallelism and activation offload), with a margin on every
    resource it uses."""
    proc = run_cli("plan", "--size", name, "--machine", "a100-40gx8", "--host-mem", "1000", "--json")
    assert proc.returncode == 0, proc.stderr
    zc = json.loads(proc.stdout)["plans"]["zero_cache"]
    assert zc["fits"] and zc["margin"]["gpu"] > 0 and zc["margin"]["host"] > 0, zc["margin"]
    assert zc["rate"] == SEED[name]["rate"]
    text = run_cli("plan", "--size", name, "--machine", "a100-40gx8", "--host-mem", "1000")
    header = next(line for line in text.stdout.splitlines() if line.startswith("== zero_cache"))
    assert f"fits (margin: gpu {zc['margin']['gpu'] / 2**30:+.2f} GiB" in header, header


@pytest.mark.parametrize("name", ["28", "55", "tiny", "125m", "1.3b", "h200-5b", "h200-16b", "llama-tiny", "llama3-8b",
                                  "h200-llama-29b"])
def test_params_equal_built_model_extrapolated(name, megatron_single_rank):
    cfg = parse(name)
    one, two = built_params(cfg, 1), built_params(cfg, 2)
    per_layer = two - one
    assert num_params(cfg) == one + (cfg.model.num_layers - 1) * per_layer


def test_h200_presets_bracket_offload():
    assert 4.5e9 < num_params(parse("h200-5b")) < 6e9
    assert 15e9 < num_params(parse("h200-16b")) < 17.5e9
    assert parse("h200-16b").optim.optimizer == "zero_cache"


@pytest.mark.slow  # plans the 28 shape
def test_the_h200_28b_preset_is_the_run_that_trained_the_28_shape_on_one_h200():
    """h200-28b is the 28 preset's layer shape with the settings of the H200 run that trained it (the
    h200-16b preset with overrides then): the same model, optimizer settings and batches; the planner
    says it fits one H200 before launch."""
    from angelgpt.planner import MACHINES, auto_plan
    from tests.planner_runs import config_of, result

    cfg = parse("h200-28b")
    ran = config_of(result("peers-zero_cache-L26-mb2-gb8-heads128-remainderstrue-expavgfp8-expavgsqfp8-"
                           "fp32sumsfalse.json"))
    from dataclasses import replace

    settled = dict(activation_offload=ran.model.activation_offload, transformer_impl=ran.model.transformer_impl)
    assert replace(cfg.model, **settled) == ran.model and cfg.parallel == ran.parallel  # as the run settled 'auto'
    assert (cfg.train.micro_batch_size, cfg.train.global_batch_size) == (ran.train.micro_batch_size, 8)
    o, r = cfg.optim, ran.optim
    assert (o.optimizer, o.exp_avg_dtype, o.exp_avg_sq_dtype, o.accumulate_grads_in_fp32) == \
        (r.optimizer, r.exp_avg_dtype, r.exp_avg_sq_dtype, r.accumulate_grads_in_fp32) == ("zero_cache", "fp8", "fp8", False)
    assert o.store_param_remainders == "auto" and r.store_param_remainders is True  # 'auto' is on on a GPU
    seed = SEED["28"]
    assert all(getattr(cfg.model, k) == seed[k] for k in ("num_layers", "hidden_size", "num_attention_heads",
                                                           "ffn_hidden_size", "kv_channels", "seq_length"))
    assert auto_plan(cfg, MACHINES["h200"]).fits


@pytest.mark.subprocess
def test_presets_list_names_every_preset():
    proc = run_cli("presets", "list")
    assert proc.returncode == 0
    for name in ("tiny", "125m", "1.3b", "28", "55", "h200-5b", "h200-16b", "h200-28b", "llama-tiny", "llama3-8b",
                 "h200-llama-29b", "custom"):
        assert any(line.split()[0] == name for line in proc.stdout.splitlines()[1:]), name
    rows = {line.split()[0]: line.split() for line in proc.stdout.splitlines()[1:]}
    assert rows["tiny"][5] == "0.14M" and rows["125m"][5] == "124.5M" and rows["55"][5] == "55.198B"


def test_format_params():
    assert [format_params(n) for n in (136_960, 3_327_744, 124_475_904, 1_315_819_520, 55_198_007_296)] == \
        ["0.14M", "3.3M", "124.5M", "1.316B", "55.198B"]


def test_presets_table_matches_the_code():
    """docs/presets.md's table: a row for every preset in `angelgpt presets list`'s order, its shape and
    params column as that list prints them (the exact count from num_params); `custom`, no preset, is
    named out of the table."""
    text = (ROOT / "docs" / "presets.md").read_text().split("# Presets", 1)[1]
    table = [line for line in text.split("\n\n", 2)[1].splitlines() if line.startswith("| ")]
    header = [c.strip() for c in table[0].strip("|").split("|")]
    rows = [dict(zip(header, [c.strip() for c in line.strip("|").split("|")])) for line in table[1:]]
    assert [r["preset"] for r in rows] == [n for n in preset_names() if n != "custom"]
    assert "`custom`, which is no preset" in text.split("\n## ", 1)[0]
    for row in rows:
        cfg = parse(row["preset"])
        m = cfg.model
        assert (row["layers"], row["hidden"], row["heads"].split()[0], row["seq"], row["optimizer"]) == \
            (str(m.num_layers), str(m.hidden_size), str(m.num_attention_heads), str(m.seq_length),
             cfg.optim.optimizer), row
        groups = f"{m.num_query_groups} kv groups"
        assert row["heads"] in (str(m.num_attention_heads), f"{m.num_attention_heads} (x{m.kv_channels})",
                                f"{m.num_attention_heads} ({groups})", f"{m.num_attention_heads} (x{m.kv_channels}, {groups})"), row
        assert ("kv groups" in row["heads"]) == (m.num_query_groups != m.num_attention_heads), row
        assert row["params"] == format_params(num_params(cfg)), (row, num_params(cfg))