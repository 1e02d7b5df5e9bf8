"""Parameters of one tensor/pipeline-parallel rank of angelgpt's GPT, in Megatron's order, from the
config alone (no torch): the names, sizes, weight-decay class and ZeRO-Cache sub-group of each.

Shapes follow Megatron's GPTModel with the local spec and the model section's options (linears' biases
with add_bias_linear, norms' biases with LayerNorm, FC1 twice ffn_hidden_size wide with swiglu): column-
parallel weights and biases (QKV, FC1, vocabulary) split over TP, row-parallel weights split and
their biases whole, norms whole; layers split evenly over PP; the position embedding on the first
stage, the output layer on the last (its own weight when untied or when PP > 1).
"""

from __future__ import annotations

from typing import List, NamedTuple, Tuple

from angelgpt.config import Config


class Param(NamedTuple):
    name: str
    numel: int
    decay: bool
    sub_group: int  # 0 embedding, 1 + layer, num_layers + 1 final norm and output


def rank_params(cfg: Config, pp_rank: int = 0) -> List[Param]:
    m = cfg.model
    tp, pp = cfg.parallel.tensor_model_parallel_size, cfg.parallel.pipeline_model_parallel_size
    h, f, fc1 = m.hidden_size, m.ffn_hidden_size, m.ffn_hidden_size * (2 if m.swiglu else 1)
    q, kv = m.num_attention_heads * m.kv_channels, m.num_query_groups * m.kv_channels
    vocab = cfg.padded_vocab_size()
    first, last = pp_rank == 0, pp_rank == pp - 1
    per_stage = m.num_layers // pp
    out: List[Param] = []
    if first:
        out.append(Param("embedding.word_embeddings.weight", vocab // tp * h, True, 0))
        if m.position_embedding_type == "learned_absolute":
            out.append(Param("embedding.position_embeddings.weight", m.seq_length * h, True, 0))
    for local in range(per_stage):
        layer = pp_rank * per_stage + local
        g = 1 + layer
        p = f"decoder.layers.{local}."
        out += [
            Param(p + "input_layernorm.weight", h, False, g),
            Param(p + "input_layernorm.bias", h, False, g),
            Param(p + "self_attention.linear_proj.weight", h * q // tp, True, g),
            Param(p + "self_attention.linear_proj.bias", h, False, g),
            Param(p + "self_attention.linear_qkv.weight", (q + 2 * kv) // tp * h, True, g),
            Param(p + "self_attention.linear_qkv.bias", (q + 2 * kv) // tp, False, g),
            Param(p + "pre_mlp_layernorm.weight", h, False, g),
            Param(p + "pre_mlp_layernorm.bias", h, False, g),
            Param(p + "mlp.linear_fc1.weight", fc1 // tp * h, True, g),
            Param(p + "mlp.linear_fc1.bias", fc1 // tp, False, g),
            Param(p + "mlp.linear_fc2.weight", h * f // tp, True, g),
            Param(p + "mlp.linear_fc2.bias", h, False, g),
        ]
    if last:
        g = m.num_layers + 1
        out += [Param("decoder.final_layernorm.weight", h, False, g),
                Param("decoder.final_layernorm.bias", h, False, g)]
        if m.untie_embeddings_and_output_weights or pp > 1:
            out.append(Param("output_layer.weight", vocab // tp * h, True, g))
    return [p for p in out if _built(cfg, p.name)]


def _built(cfg: Config, name: str) -> bool:
    """Whether the model has this parameter: norms' biases only with LayerNorm, linears' only with
    add_bias_linear (linear_qkv's with add_qkv_bias too)."""
    if not name.endswith(".bias"):
        return True
    if "layernorm" in name:
        return cfg.model.normalization == "LayerNorm"
    return cfg.model.add_bias_linear or ("linear_qkv" in name and cfg.model.add_qkv_bias)


def chunk_numels(params: List[Param], dp_size: int, dp_rank: int, cap: int) -> List[Tuple[int, int]]:
    """(sub-group position, size) of the chunks this DP rank owns, in the optimizer's order (sub-group,
    decay before no-decay, parameters packed up to `cap` elements: zero_cache.chunk_numel); positions
    count the sub-groups this pipeline stage has, from 0."""
    from angelgpt.zero_cache.placement import chunk_runs, partition

    owners = partition([p.numel for p in params], dp_size)
    chunks = []
    for pos, g in enumerate(sorted({p.sub_group for p in params})):
        for decay in (True, False):
            mine = [p.numel for p, o in zip(params, owners) if p.sub_group == g and p.decay == decay and o == dp_rank]
            chunks += [(pos, sum(mine[i] for i in run)) for run in chunk_runs(mine, cap)]
    return chunks
