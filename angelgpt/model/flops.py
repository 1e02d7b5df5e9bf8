"""Parameter and FLOP counts of angelgpt's GPT, from the config alone (no torch needed).

Shapes match Megatron's GPTModel with the local or transformer-engine spec and the model section's
architecture options: LayerNorm (weight and bias) or RMSNorm (weight), linears with or without biases
(add_bias_linear), a GELU MLP or a SwiGLU one (linear_fc1 2 * ffn_hidden_size wide), grouped-query
attention (K and V num_query_groups heads wide), learned positions or RoPE (no parameters), the
vocabulary padded as Megatron pads it.
"""

from __future__ import annotations

from angelgpt.config import Config


def _dims(cfg: Config):
    m = cfg.model
    q = m.num_attention_heads * m.kv_channels
    kv = m.num_query_groups * m.kv_channels
    return m.hidden_size, q, kv, m.ffn_hidden_size


def norm_params(cfg: Config) -> int:
    """One norm's parameters: weight and bias (LayerNorm) or weight (RMSNorm)."""
    return cfg.model.hidden_size * (2 if cfg.model.normalization == "LayerNorm" else 1)


def fc1_width(cfg: Config) -> int:
    """linear_fc1's outputs: ffn_hidden_size, twice that with swiglu (gate and up)."""
    return cfg.model.ffn_hidden_size * (2 if cfg.model.swiglu else 1)


def params_per_layer(cfg: Config) -> int:
    h, q, kv, f = _dims(cfg)
    bias = cfg.model.add_bias_linear
    attention = h * (q + 2 * kv) + q * h + (bias or cfg.model.add_qkv_bias) * (q + 2 * kv) + bias * h
    mlp = h * fc1_width(cfg) + f * h + bias * (fc1_width(cfg) + h)
    return 2 * norm_params(cfg) + attention + mlp


def embedding_params(cfg: Config) -> int:
    """Input embedding, learned positions, final norm and (untied) output layer."""
    h = cfg.model.hidden_size
    vocab = cfg.padded_vocab_size()
    total = vocab * h + norm_params(cfg)
    if cfg.model.position_embedding_type == "learned_absolute":
        total += cfg.model.seq_length * h
    if cfg.model.untie_embeddings_and_output_weights:
        total += vocab * h
    return total


def num_params(cfg: Config) -> int:
    """Exact parameter count of the whole model (all TP and PP shards together)."""
    return embedding_params(cfg) + cfg.model.num_layers * params_per_layer(cfg)


def format_params(n: int) -> str:
    """A parameter count in a unit that fits, as docs/presets.md's table writes it: 0.14M, 124.5M,
    1.316B, 55.198B."""
    if n >= 10**9:
        return f"{n / 1e9:.3f}B"
    return f"{n / 1e6:.1f}M" if n >= 10**6 else f"{n / 1e6:.2f}M"


def layer_forward_flops_per_token(cfg: Config) -> int:
    """Matmul FLOPs of one layer's forward per token: 2 a weight (QKV with GQA's narrower K and V, the
    projection, linear_fc1 with SwiGLU's gate and up, linear_fc2) and the attention's two products, of
    which causal attention counts half of the s x s square. Three times this is Megatron-LM's
    num_floating_point_operations per layer and token, 12*h^2*((1 + groups/heads + s/h)*q/h + f/h*glu)
    with glu 3/2 for SwiGLU, except its attention term counts the whole square (12*s*q where this
    counts 6*s*q)."""
    h, q, kv, f = _dims(cfg)
    matmul_params = h * (q + 2 * kv) + q * h + h * fc1_width(cfg) + f * h
    attention = 2 * cfg.model.seq_length * q  # QK^T and AV: 2 * (2 * s * q) / 2 for the causal half
    return 2 * matmul_params + attention


def head_forward_flops_per_token(cfg: Config) -> int:
    """Matmul FLOPs of the output layer's forward per token (the logits)."""
    return 2 * cfg.model.hidden_size * cfg.padded_vocab_size()


def flops_per_iteration(cfg: Config, include_recompute: bool = False) -> int:
    """Model FLOPs of one optimizer step (forward + backward = 3 x forward, with the logits).

    include_recompute adds the extra forward of every layer that full activation recompute runs,
    giving the hardware FLOPs.
    """
    tokens = cfg.train.global_batch_size * cfg.model.seq_length
    layers = cfg.model.num_layers * layer_forward_flops_per_token(cfg)
    total = 3 * tokens * (layers + head_forward_flops_per_token(cfg))
    if include_recompute:
        total += tokens * recomputed_layers(cfg) * layer_forward_flops_per_token(cfg)
    return total


def recomputed_layers(cfg: Config) -> int:
    """Layers (all pipeline stages together) whose forward runs again in backward."""
    m = cfg.model
    if m.recompute != "full":
        return 0
    pp = cfg.parallel.pipeline_model_parallel_size
    return m.num_layers if m.recompute_num_layers is None else m.recompute_num_layers * pp
