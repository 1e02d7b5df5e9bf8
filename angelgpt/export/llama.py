"""angelgpt's Llama-style GPT as Hugging Face Llama (``LlamaForCausalLM``): the config and every tensor's mapping.

    from angelgpt.export.checkpoint_reader import CheckpointReader
    from angelgpt.export.llama import llama_config, llama_tensors
    reader = CheckpointReader.open("runs/ck")
    config = llama_config(reader)                     # dict for config.json; ConfigError if not Llama
    for name, shape, make in llama_tensors(reader, torch.float32):
        tensor = make()                               # reads and converts one tensor when called

A checkpoint is Llama's architecture when its norms are RMSNorm (``model.normalization``), its MLP is
SwiGLU (``model.swiglu``), its positions are RoPE over whole heads (``model.position_embedding_type``
rope, ``model.rotary_percent`` 1); grouped-query attention, untied output weights, linear biases (all
or none: ``attention_bias`` and ``mlp_bias``), any norm epsilon and any head size (``head_dim``; the
hidden size a multiple of the heads, as LlamaConfig checks) are expressed. The
mapping, as Megatron-core computes and transformers' modeling_llama does:
- ``linear_qkv`` rows interleave by query group (its query heads, its key head, its value head;
  ``SelfAttention.get_query_key_value_tensors``): split into ``q_proj``, ``k_proj``, ``v_proj``
  (gpt2.split_qkv); query head j uses key/value head j // (heads / groups), as ``repeat_kv`` does;
- RoPE: Megatron's RotaryEmbedding (``rotary_interleaved`` False) rotates the two halves of each head
  (``_rotate_half``: cat(-x2, x1)) with inv_freq = 1 / base^(arange(0, d, 2) / d), as transformers'
  ``rotate_half`` and default rope; no permutation of q or k rows is needed;
- ``linear_fc1`` computes [gate; up] (``MLP.glu``: chunk(2), silu(first) * second). Megatron saves
  its per-rank [gate_r; up_r] halves as two regions of one global tensor, all gates then all ups
  (``apply_swiglu_sharded_factory``), so the stored tensor's first ffn rows are ``gate_proj``, the
  rest ``up_proj``, at any TP;
- RMSNorm x / sqrt(mean(x^2) + eps) * weight in both; the input norm is stored as
  ``linear_qkv.layer_norm_weight``, the pre-MLP one as ``linear_fc1.layer_norm_weight``;
- the vocabulary is the padded one, or with ``trim_vocab`` ``model.vocab_size`` (embedding and
  ``lm_head`` rows past it dropped).
"""

from __future__ import annotations

from typing import Callable, Iterator, Optional, Tuple

import torch

from angelgpt.config import ConfigError
from angelgpt.export.gpt2 import FC1, FC2, PROJ, QKV, padded_vocab, split_qkv


def llama_problem(reader) -> Optional[str]:
    """Why the checkpoint's architecture is not Llama's (naming the config field), or None when it is."""
    m = reader.config["model"]
    norm = m.get("normalization", "LayerNorm")
    pos = m.get("position_embedding_type", "learned_absolute")
    bias = m.get("add_bias_linear", True)
    if norm != "RMSNorm":
        return f"model.normalization is {norm} (Llama's norms are RMSNorm)"
    if pos != "rope":
        return f"model.position_embedding_type is {pos} (Llama's positions are rope)"
    if m.get("rotary_percent", 1.0) != 1.0:
        return (f"model.rotary_percent is {m['rotary_percent']} (Llama's rope rotates every channel of a "
                f"head)")
    if not m.get("swiglu"):
        return "model.swiglu is false (Llama's MLP is gated: silu(gate) * up)"
    if m["hidden_size"] % m["num_attention_heads"]:
        return (f"model.hidden_size {m['hidden_size']} is not a multiple of model.num_attention_heads "
                f"{m['num_attention_heads']} (LlamaConfig requires it)")
    if reader.num_layers() != m["num_layers"]:
        return f"it stores {reader.num_layers()} layers where model.num_layers says {m['num_layers']}"
    needed = [f"{QKV}.weight", f"{QKV}.layer_norm_weight", f"{PROJ}.weight", f"{FC1}.weight",
              f"{FC1}.layer_norm_weight", f"{FC2}.weight"]
    if bias:
        needed += [f"{QKV}.bias", f"{PROJ}.bias", f"{FC1}.bias", f"{FC2}.bias"]
    missing = [f"{k} of layer {i}" for i in range(m["num_layers"]) for k in needed if not reader.has(k, i)]
    top = ["embedding.word_embeddings.weight", "decoder.final_layernorm.weight"]
    if m.get("untie_embeddings_and_output_weights"):
        top.append("output_layer.weight")
    missing += [k for k in top if not reader.has(k)]
    if missing:
        return f"it has no {missing[0]}"
    fc1 = reader.shape(f"{FC1}.weight", 0)[0]
    if fc1 != 2 * m["ffn_hidden_size"]:
        return f"its linear_fc1 has {fc1} outputs, not 2 x model.ffn_hidden_size {m['ffn_hidden_size']}"
    return None


def check_llama(reader) -> None:
    """Raises ConfigError when the checkpoint's architecture is not Llama's."""
    why = llama_problem(reader)
    if why:
        raise ConfigError(f"checkpoint {reader.path} cannot be exported as Llama: {why}")


def llama_config(reader, trim_vocab: bool = False, dtype: Optional[torch.dtype] = None,
                 bos_token_id: Optional[int] = None, eos_token_id: Optional[int] = None) -> dict:
    """config.json of the LlamaForCausalLM: LlamaConfig's fields (RoPE's base both as transformers 5's
    ``rope_parameters`` and as transformers 4's ``rope_theta``; ``dtype`` and its older name
    ``torch_dtype``)."""
    check_llama(reader)
    m = reader.config["model"]
    bias = bool(m.get("add_bias_linear", True))
    base = float(m.get("rotary_base", 10000))
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": m["vocab_size"] if trim_vocab else padded_vocab(reader),
        "hidden_size": m["hidden_size"],
        "intermediate_size": m["ffn_hidden_size"],
        "num_hidden_layers": m["num_layers"],
        "num_attention_heads": m["num_attention_heads"],
        "num_key_value_heads": m["num_query_groups"],
        "head_dim": m["kv_channels"],
        "hidden_act": "silu",
        "max_position_embeddings": m["seq_length"],
        "rms_norm_eps": m.get("norm_epsilon", 1e-5),
        "rope_parameters": {"rope_type": "default", "rope_theta": base},
        "rope_theta": base,
        "attention_bias": bias,
        "mlp_bias": bias,
        "attention_dropout": m.get("attention_dropout", 0.0),
        "initializer_range": m.get("init_method_std", 0.02),
        "pretraining_tp": 1,
        "tie_word_embeddings": not m.get("untie_embeddings_and_output_weights", False),
        "use_cache": True,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "pad_token_id": None,
    }
    if dtype is not None:
        config["dtype"] = config["torch_dtype"] = str(dtype).replace("torch.", "")
    return config


Tensor = Tuple[str, Tuple[int, ...], Callable[[], torch.Tensor]]


def llama_tensors(reader, dtype: torch.dtype, trim_vocab: bool = False) -> Iterator[Tensor]:
    """(name, shape, make) for every tensor of the LlamaForCausalLM's state dict (``lm_head.weight`` only
    when untied). ``make()`` reads what it needs and returns the converted tensor, contiguous, in dtype;
    a layer's linear_qkv is read once for its q, k and v (memory holds it and one part)."""
    check_llama(reader)
    m = reader.config["model"]
    h, heads, groups, d = m["hidden_size"], m["num_attention_heads"], m["num_query_groups"], m["kv_channels"]
    ffn = m["ffn_hidden_size"]
    bias = m.get("add_bias_linear", True)
    vocab = m["vocab_size"] if trim_vocab else padded_vocab(reader)
    held = {}  # (key, layer) -> the split q, k, v of the linear_qkv last read

    def plain(key, layer=None, rows=None):
        def make():
            t = reader.read(key, layer)
            return (t if rows is None else t[:rows]).to(dtype).contiguous()
        return make

    def qkv_part(key, layer, part):
        def make():
            if (key, layer) not in held:
                held.clear()
                held[(key, layer)] = split_qkv(reader.read(key, layer), heads, groups, d)
            return held[(key, layer)][part].to(dtype).contiguous()
        return make

    def fc1_half(key, layer, half):  # rows [0, ffn) gate, [ffn, 2 ffn) up
        def make():
            shape = (ffn, *reader.shape(key, layer)[1:])
            region = torch.empty(shape, dtype=reader.dtype(key, layer))
            reader.read_into(key, region, layer, (half * ffn,) + (0,) * (len(shape) - 1))
            return region.to(dtype).contiguous()
        return make

    yield "model.embed_tokens.weight", (vocab, h), plain("embedding.word_embeddings.weight", rows=vocab)
    for i in range(m["num_layers"]):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", (h,), plain(f"{QKV}.layer_norm_weight", i)
        projections = [("q_proj", heads * d), ("k_proj", groups * d), ("v_proj", groups * d)]
        for part, (name, rows) in enumerate(projections):
            yield p + f"self_attn.{name}.weight", (rows, h), qkv_part(f"{QKV}.weight", i, part)
        for part, (name, rows) in enumerate(projections if bias else []):
            yield p + f"self_attn.{name}.bias", (rows,), qkv_part(f"{QKV}.bias", i, part)
        yield p + "self_attn.o_proj.weight", (h, heads * d), plain(f"{PROJ}.weight", i)
        if bias:
            yield p + "self_attn.o_proj.bias", (h,), plain(f"{PROJ}.bias", i)
        yield p + "post_attention_layernorm.weight", (h,), plain(f"{FC1}.layer_norm_weight", i)
        for half, name in enumerate(["gate_proj", "up_proj"]):
            yield p + f"mlp.{name}.weight", (ffn, h), fc1_half(f"{FC1}.weight", i, half)
            if bias:
                yield p + f"mlp.{name}.bias", (ffn,), fc1_half(f"{FC1}.bias", i, half)
        yield p + "mlp.down_proj.weight", (h, ffn), plain(f"{FC2}.weight", i)
        if bias:
            yield p + "mlp.down_proj.bias", (h,), plain(f"{FC2}.bias", i)
    yield "model.norm.weight", (h,), plain("decoder.final_layernorm.weight")
    if m.get("untie_embeddings_and_output_weights"):
        yield "lm_head.weight", (vocab, h), plain("output_layer.weight", rows=vocab)
