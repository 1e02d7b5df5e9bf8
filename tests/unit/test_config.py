"""Precedence: KEY=VALUE overrides > user YAML > preset > dataclass defaults."""

import dataclasses
import typing

import pytest
from pydantic import ValidationError

from angelgpt.config import ConfigError, ResolvedConfig, parse
from angelgpt.config.schema import SECTIONS, Config, type_text


def test_precedence(tmp_path):
    user = tmp_path / "user.yaml"
    user.write_text("model:\n  num_layers: 3\n  hidden_size: 128\ntrain:\n  train_iters: 7\n")
    cfg = parse("tiny", str(user), ["model.num_layers=5"])
    assert cfg.model.num_layers == 5          # override beats YAML
    assert cfg.model.hidden_size == 128       # YAML beats preset (64)
    assert cfg.model.seq_length == 64         # preset beats default (128)
    assert cfg.optim.adam_beta2 == Config().optim.adam_beta2  # default where nobody speaks
    assert cfg.train.train_iters == 7


def test_bare_keys_and_scalar_sections():
    cfg = parse("tiny", overrides=["num_layers=4", "prefetch_cache_sub_group_rate=auto", "data=mock"])
    assert cfg.model.num_layers == 4
    assert cfg.zero_cache.prefetch_cache_sub_group_rate == "auto"
    assert cfg.data.is_mock


def test_derived_fields():
    cfg = parse("custom", overrides=["hidden_size=96", "num_attention_heads=6"])
    assert cfg.model.kv_channels == 16 and cfg.model.ffn_hidden_size == 384 and cfg.model.num_query_groups == 6


@pytest.mark.parametrize("overrides, needle", [
    (["zero_cache.prefetch_cache_sub_group_rate=1.5"], "prefetch_cache_sub_group_rate"),
    (["zero_cache.max_contigous_params_size=0"], "max_contigous_params_size"),
    (["zero_cache.cpu_adam=avx"], "zero_cache.cpu_adam must be 'auto', 'native' or 'torch', got 'avx'"),
    (["optim.optimizer=sgd"], "optim.optimizer"),
    (["optim.optimizer=zero_cache", "optim.exp_avg_sq_dtype=int8"],
     "optim.exp_avg_sq_dtype must be 'fp32', 'bf16' or 'fp8', got 'int8'"),
    (["optim.exp_avg_dtype=fp8"], "optim.exp_avg_dtype is honoured by optim.optimizer 'zero_cache' only"),
    (["optim.store_param_remainders=true"], "optim.store_param_remainders is honoured by optim.optimizer 'zero_cache'"),
    (["optim.optimizer=zero_cache", "optim.exp_avg_sq_dtype=bf16", "optim.adam_beta2=0.999"],
     "optim.exp_avg_sq_dtype 'bf16' needs optim.adam_beta2 <= 0.99"),
    (["train.device=tpu"], "train.device"),
    (["num_layers=true"], "model.num_layers"),
    (["model.recompute_num_layers=1"], "needs model.recompute 'full'"),
    (["model.recompute=full", "model.recompute_num_layers=3"], r"recompute_num_layers must be in \[1, num_layers=2\]"),
    (["model.recompute=full", "model.recompute_num_layers=2", "parallel.pipeline_model_parallel_size=2"],
     "at most 1 with 2 stages"),
])
def test_section_checks(overrides, needle):
    with pytest.raises(ConfigError, match=needle):
        parse("tiny", overrides=overrides)


def test_world_size_checks():
    cfg = parse("tiny", overrides=["parallel.tensor_model_parallel_size=2"])
    assert cfg.data_parallel_size(4) == 2
    with pytest.raises(ConfigError, match="not divisible"):
        cfg.data_parallel_size(3)
    with pytest.raises(ConfigError, match="global_batch_size"):
        parse("tiny", overrides=["train.micro_batch_size=8"]).data_parallel_size(2)


def test_exponent_without_dot_is_a_float():
    assert parse("tiny", overrides=["optim.lr=1e-2"]).optim.lr == 1e-2


@pytest.mark.parametrize("override, message", [
    ("model.num_layers=abc", "model.num_layers: expected int, got 'abc'"),
    ("model.num_layers='4'", "model.num_layers: expected int, got '4'"),  # no string becomes an int
    ("model.kv_channels=1.5", "model.kv_channels: expected int or None, got 1.5"),
    ("model.swiglu=1", "model.swiglu: expected bool, got 1"),
    ("optim.lr=true", "optim.lr: expected float, got True"),
    ("optim.lr=.inf", "optim.lr: expected float, got inf"),
    ("zero_cache.offload_params=maybe", "zero_cache.offload_params: expected bool or 'auto', got 'maybe'"),
    ("zero_cache.device_update_fraction=most",
     "zero_cache.device_update_fraction: expected float or 'auto', got 'most'"),
    ("model.recompute=selective", "model.recompute must be 'none', 'full' or 'auto', got 'selective'"),
    ("optim.custom_import=x", "optim.custom_import: expected list of str, got 'x'"),
])
def test_a_value_of_the_wrong_type_is_refused_naming_the_key(override, message):
    with pytest.raises(ConfigError) as err:
        parse("tiny", overrides=[override])
    assert str(err.value) == message


def test_ints_are_taken_for_floats():
    cfg = parse("tiny", overrides=["optim.clip_grad=2", "zero_cache.prefetch_cache_sub_group_rate=1"])
    assert cfg.optim.clip_grad == 2.0 and isinstance(cfg.optim.clip_grad, float)
    assert cfg.zero_cache.prefetch_cache_sub_group_rate == 1.0


def test_the_old_name_of_a_moved_key_sets_the_new_one():
    assert parse("tiny", overrides=["zero_cache.save_large_model_multi_slice=false"]).checkpoint.multi_slice is False


def test_no_field_of_a_resolved_config_admits_auto():
    """Every setting a parsed config may leave 'auto' is narrowed in ResolvedConfig to its values."""
    resolved = typing.get_type_hints(ResolvedConfig)
    for name, cls in SECTIONS.items():
        narrowed = typing.get_type_hints(resolved[name], include_extras=True)
        assert [f.name for f in dataclasses.fields(cls) if "'auto'" in type_text(narrowed[f.name])] == [], name


AUTO_FIELDS = [f"{name}.{f.name}" for name, cls in SECTIONS.items() for f in dataclasses.fields(cls)
               if "'auto'" in type_text(typing.get_type_hints(cls, include_extras=True)[f.name])]


@pytest.mark.parametrize("key", AUTO_FIELDS)
def test_a_resolved_config_refuses_auto_at_construction(key):
    """A ResolvedConfig (what resolve_config returns, what the worker and the optimizers build from) holds
    no 'auto': constructing one with an 'auto' is refused naming the field."""
    from angelgpt.planner import MACHINES, resolve_config

    resolved, _ = resolve_config(parse("tiny", overrides=["optim.optimizer=zero_cache"]), MACHINES["h200"], 1, 1,
                                 on_gpu=False)
    section, name = key.split(".")
    with pytest.raises(ValidationError, match=rf"\n{name}\n"):
        dataclasses.replace(getattr(resolved, section), **{name: "auto"})
    assert len(AUTO_FIELDS) >= 10
