"""checkpoint_check.model_mismatch: a checkpoint's config against a run's, the fields that shape parameters
only (the CLI's refusals are in tests/distributed/test_resume_checks.py)."""

from angelgpt.config import parse, to_dict
from angelgpt.train.checkpoint_check import model_mismatch


def _config(*overrides):
    return to_dict(parse("tiny", None, list(overrides)))


def test_training_settings_and_resharding_layout_are_the_same_model():
    saved = _config()
    assert model_mismatch(saved, _config("train.global_batch_size=16", "optim.lr=1e-3", "train.train_iters=9",
                                         "parallel.tensor_model_parallel_size=2", "optim.optimizer=zero_cache",
                                         "model.hidden_dropout=0.1")) is None


def test_tensor_parallel_size_that_pads_the_vocabulary_otherwise_is_named():
    saved = _config("model.vocab_size=50257")
    assert model_mismatch(saved, _config("model.vocab_size=50257", "parallel.tensor_model_parallel_size=2")) == (
        "padded vocabulary (model.make_vocab_size_divisible_by x parallel.tensor_model_parallel_size): "
        "checkpoint 50304, config 50432")
    assert model_mismatch(saved, _config("model.vocab_size=50300")) is None  # the same padded rows


def test_first_differing_shape_field_is_named():
    saved = _config()
    assert model_mismatch(saved, _config("model.num_query_groups=2")) == "model.num_query_groups: checkpoint 4, config 2"
    assert model_mismatch(saved, _config("model.hidden_size=128", "model.num_layers=4")) == \
        "model.num_layers: checkpoint 2, config 4"
    assert model_mismatch(saved, _config("model.ffn_hidden_size=128")) == \
        "model.ffn_hidden_size: checkpoint 256, config 128"


def test_seq_length_counts_only_with_learned_position_embeddings():
    rope = _config("model.position_embedding_type=rope")
    assert model_mismatch(rope, _config("model.position_embedding_type=rope", "model.seq_length=128")) is None
    assert model_mismatch(_config(), _config("model.seq_length=128")) == "model.seq_length: checkpoint 64, config 128"


def test_an_architecture_switch_that_adds_or_reshapes_parameters_is_named():
    """SwiGLU doubles fc1's rows; RMSNorm has no bias where LayerNorm has one; linear and QKV biases
    exist or not. A rotary base is no parameter: a run may resume with another (context extension)."""
    saved = to_dict(parse("llama-tiny", None, []))
    llama = lambda *o: to_dict(parse("llama-tiny", None, list(o)))  # noqa: E731
    assert model_mismatch(saved, llama("model.swiglu=false")) == "model.swiglu: checkpoint True, config False"
    assert model_mismatch(saved, llama("model.normalization=LayerNorm")) == \
        "model.normalization: checkpoint RMSNorm, config LayerNorm"
    assert model_mismatch(saved, llama("model.add_bias_linear=true")) == \
        "model.add_bias_linear: checkpoint False, config True"
    assert model_mismatch(saved, llama("model.add_qkv_bias=true")) == "model.add_qkv_bias: checkpoint False, config True"
    assert model_mismatch(saved, llama("model.rotary_base=1000000")) is None
    older = {**saved, "model": {k: v for k, v in saved["model"].items() if k != "swiglu"}}
    assert model_mismatch(older, llama("model.swiglu=false")) is None  # a field the checkpoint lacks is not compared
