"""Parameter and FLOP counts of angelgpt's GPT, from the config alone (no torch needed).

Shapes match Megatron's GPTModel with the local or transformer-engine spec: LayerNorm with bias,
biased linears, GELU MLP, vocabulary padded as Megatron pads it.
"""

from __future__ import annotations

from angelgpt.config import Config


def _dims(cfg: Config):
    m = cfg.model
    q = m.num_attention_heads * m.kv_channels
    kv = m.num_query_groups * m.kv_channels
    return m.hidden_size, q, kv, m.ffn_hidden_size


def params_per_layer(cfg: Config) -> int:
    h, q, kv, f = _dims(cfg)
    norms = 2 * (2 * h)
    attention = h * (q + 2 * kv) + (q + 2 * kv) + q * h + h
    mlp = h * f + f + f * h + h
    return norms + attention + mlp


def embedding_params(cfg: Config) -> int:
    """Input embedding, learned positions, final norm and (untied) output layer."""
    h = cfg.model.hidden_size
    vocab = cfg.padded_vocab_size()
    total = vocab * h + 2 * h
    if cfg.model.position_embedding_type == "learned_absolute":
        total += cfg.model.seq_length * h
    if cfg.model.untie_embeddings_and_output_weights:
        total += vocab * h
    return total


def num_params(cfg: Config) -> int:
    """Exact parameter count of the whole model (all TP and PP shards together)."""
    return embedding_params(cfg) + cfg.model.num_layers * params_per_layer(cfg)


def format_params(n: int) -> str:
    """A parameter count in a unit that fits, as the README's Presets table writes it: 0.14M, 124.5M,
    1.316B, 55.198B."""
    if n >= 10**9:
        return f"{n / 1e9:.3f}B"
    return f"{n / 1e6:.1f}M" if n >= 10**6 else f"{n / 1e6:.2f}M"


def layer_forward_flops_per_token(cfg: Config) -> int:
    """Matmul FLOPs of one layer's forward per token; causal attention counts half of the s x s square."""
    h, q, kv, f = _dims(cfg)
    matmul_params = h * (q + 2 * kv) + q * h + 2 * h * f
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
