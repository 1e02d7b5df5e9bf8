"""angelgpt's GPT as Hugging Face GPT-2 (``GPT2LMHeadModel``): the config and every tensor's mapping.

    from angelgpt.export.checkpoint_reader import CheckpointReader
    from angelgpt.export.gpt2 import gpt2_config, gpt2_tensors
    reader = CheckpointReader.open("runs/ck")
    config = gpt2_config(reader)                      # dict for config.json; ConfigError if not GPT-2
    for name, shape, make in gpt2_tensors(reader, torch.float32):
        tensor = make()                               # reads and converts one tensor when called

angelgpt's default architecture is GPT-2's: learned absolute positions, pre-LayerNorm with bias
(Megatron's eps 1e-5), biased linears, exact GELU (Megatron's ``F.gelu``: transformers' ``gelu``) or
with ``model.openai_gelu`` its tanh approximation (OpenAI's checkpoints: ``gelu_new``), softmax(q k^T /
sqrt(d)), tied input and output embeddings. The differences are layout:
- Megatron's ``linear_qkv`` interleaves by query group: for each group its query heads, then its key
  head, then its value head (``SelfAttention.get_query_key_value_tensors``); GPT-2's ``c_attn`` holds
  all queries, then all keys, then all values;
- GPT-2's linears are ``Conv1D`` with weights ``[in, out]``, Megatron's ``[out, in]``;
- the vocabulary is Megatron's padded one (a multiple of ``make_vocab_size_divisible_by`` x TP):
  ``vocab_size`` is the padded size, so logits match on every id, or with ``trim_vocab`` the real size
  (``model.vocab_size``), the rows past it dropped (logits on real ids are unchanged).

What GPT-2 cannot express is named by ``gpt2_problem`` (export then tries Llama, llama.py): RoPE, untied output weights,
grouped-query attention, a head size other than hidden / heads, RMSNorm, a norm epsilon other than
1e-5, a gated (SwiGLU) MLP, missing biases.
"""

from __future__ import annotations

from typing import Callable, Iterator, Optional, Tuple

import torch

from angelgpt.config import ConfigError

LN_EPS = 1e-5  # GPT-2's layer_norm_epsilon: model.norm_epsilon's default, the only value exported

QKV = "decoder.layers.self_attention.linear_qkv"
PROJ = "decoder.layers.self_attention.linear_proj"
FC1 = "decoder.layers.mlp.linear_fc1"
FC2 = "decoder.layers.mlp.linear_fc2"


def gpt2_problem(reader) -> Optional[str]:
    """Why the checkpoint's architecture is not GPT-2's, or None when it is."""
    m = reader.config["model"]
    why = None
    if m.get("position_embedding_type", "learned_absolute") != "learned_absolute":
        why = (f"it uses {m['position_embedding_type']} position embeddings (GPT-2 has learned absolute "
               f"positions only)")
    elif m.get("untie_embeddings_and_output_weights"):
        why = "its output layer has its own weights (GPT-2 ties them to the input embedding)"
    elif m["num_query_groups"] != m["num_attention_heads"]:
        why = (f"it uses grouped-query attention ({m['num_query_groups']} key/value groups for "
               f"{m['num_attention_heads']} heads; GPT-2 has one key/value head per query head)")
    elif m["kv_channels"] * m["num_attention_heads"] != m["hidden_size"]:
        why = (f"its head size {m['kv_channels']} x {m['num_attention_heads']} heads is not its hidden size "
               f"{m['hidden_size']} (GPT-2's heads split the hidden size)")
    elif m.get("normalization", "LayerNorm") != "LayerNorm":
        why = f"it uses {m['normalization']} (GPT-2's norms are LayerNorm)"
    elif m.get("norm_epsilon", LN_EPS) != LN_EPS:
        why = f"its norms' epsilon is {m['norm_epsilon']} (GPT-2 exports 1e-5 here)"
    elif m.get("swiglu"):
        why = "its MLP is gated (SwiGLU; GPT-2's is GELU)"
    elif reader.num_layers() != m["num_layers"]:
        why = f"it stores {reader.num_layers()} layers where its config says {m['num_layers']}"
    elif reader.has("output_layer.weight"):
        why = "it stores a separate output layer (GPT-2 ties it to the input embedding)"
    else:
        needed = [f"{QKV}.weight", f"{QKV}.bias", f"{QKV}.layer_norm_weight", f"{QKV}.layer_norm_bias",
                  f"{PROJ}.weight", f"{PROJ}.bias", f"{FC1}.weight", f"{FC1}.bias", f"{FC1}.layer_norm_weight",
                  f"{FC1}.layer_norm_bias", f"{FC2}.weight", f"{FC2}.bias"]
        missing = [f"{k} of layer {i}" for i in range(m["num_layers"]) for k in needed if not reader.has(k, i)]
        missing += [k for k in ("embedding.word_embeddings.weight", "embedding.position_embeddings.weight",
                                "decoder.final_layernorm.weight", "decoder.final_layernorm.bias")
                    if not reader.has(k)]
        if missing:
            why = f"it has no {missing[0]} (GPT-2 has biased linears and LayerNorms with bias)"
        elif reader.shape(f"{FC1}.weight", 0)[0] != m["ffn_hidden_size"]:
            why = (f"its MLP's first layer has {reader.shape(f'{FC1}.weight', 0)[0]} outputs for ffn_hidden_size "
                   f"{m['ffn_hidden_size']} (a gated MLP; GPT-2's is not gated)")
    return why


def check_gpt2(reader) -> None:
    """Raises ConfigError when the checkpoint's architecture is not GPT-2's."""
    why = gpt2_problem(reader)
    if why:
        raise ConfigError(f"checkpoint {reader.path} cannot be exported as GPT-2: {why}")


def padded_vocab(reader) -> int:
    return int(reader.shape("embedding.word_embeddings.weight")[0])


def gpt2_config(reader, trim_vocab: bool = False, dtype: Optional[torch.dtype] = None,
                bos_token_id: Optional[int] = None, eos_token_id: Optional[int] = None) -> dict:
    """config.json of the GPT2LMHeadModel: GPT2Config's fields, written out here so that the directory
    reads with transformers 4 and 5 alike (``dtype`` and its older name ``torch_dtype``)."""
    check_gpt2(reader)
    m = reader.config["model"]
    config = {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": m["vocab_size"] if trim_vocab else padded_vocab(reader),
        "n_positions": int(reader.shape("embedding.position_embeddings.weight")[0]),
        "n_embd": m["hidden_size"],
        "n_layer": m["num_layers"],
        "n_head": m["num_attention_heads"],
        "n_inner": m["ffn_hidden_size"],
        "activation_function": "gelu_new" if m.get("openai_gelu") else "gelu",  # tanh approximation, or exact
        "resid_pdrop": m.get("hidden_dropout", 0.0),
        "embd_pdrop": m.get("hidden_dropout", 0.0),
        "attn_pdrop": m.get("attention_dropout", 0.0),
        "layer_norm_epsilon": LN_EPS,
        "initializer_range": m.get("init_method_std", 0.02),
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "add_cross_attention": False,
        "tie_word_embeddings": True,
        "use_cache": True,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "pad_token_id": None,
    }
    if dtype is not None:
        config["dtype"] = config["torch_dtype"] = str(dtype).replace("torch.", "")
    return config


def split_qkv(t: torch.Tensor, heads: int, groups: int,
              head_dim: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Megatron's per-group interleaved rows [q of group 0, k0, v0, q of group 1, ...] (first axis) as
    (all q heads, all k heads, all v heads), each in head order: query head j belongs to key/value
    group j // (heads / groups), as transformers' ``repeat_kv`` pairs them. Works on weights [rows, in]
    and biases [rows]."""
    per_group = heads // groups
    rest = t.shape[1:]
    grouped = t.reshape(groups, per_group + 2, head_dim, *rest)
    q = grouped[:, :per_group].reshape(heads * head_dim, *rest)
    k = grouped[:, per_group].reshape(groups * head_dim, *rest)
    v = grouped[:, per_group + 1].reshape(groups * head_dim, *rest)
    return q, k, v


def qkv_to_gpt2(t: torch.Tensor, heads: int, groups: int, head_dim: int) -> torch.Tensor:
    """Megatron's linear_qkv rows as GPT-2's c_attn rows [all q, all k, all v]."""
    return torch.cat(split_qkv(t, heads, groups, head_dim), dim=0)


Tensor = Tuple[str, Tuple[int, ...], Callable[[], torch.Tensor]]


def gpt2_tensors(reader, dtype: torch.dtype, trim_vocab: bool = False) -> Iterator[Tensor]:
    """(name, shape, make) for every tensor of the GPT2LMHeadModel's state dict in write order (the output
    head is tied to transformer.wte and not stored). ``make()`` reads what it needs from the checkpoint
    and returns the converted tensor, contiguous, in dtype."""
    check_gpt2(reader)
    m = reader.config["model"]
    h, heads, ffn, d = m["hidden_size"], m["num_attention_heads"], m["ffn_hidden_size"], m["kv_channels"]
    groups = m["num_query_groups"]
    vocab = m["vocab_size"] if trim_vocab else padded_vocab(reader)

    def plain(key, layer=None, transpose=False, rows=None):
        def make():
            t = reader.read(key, layer)
            if rows is not None:
                t = t[:rows]
            if transpose:
                t = t.t()
            return t.to(dtype).contiguous()
        return make

    def qkv(key, layer, transpose):
        def make():
            t = qkv_to_gpt2(reader.read(key, layer), heads, groups, d)
            return (t.t() if transpose else t).to(dtype).contiguous()
        return make

    yield "transformer.wte.weight", (vocab, h), plain("embedding.word_embeddings.weight", rows=vocab)
    n_pos = int(reader.shape("embedding.position_embeddings.weight")[0])
    yield "transformer.wpe.weight", (n_pos, h), plain("embedding.position_embeddings.weight")
    for i in range(m["num_layers"]):
        p = f"transformer.h.{i}."
        yield p + "ln_1.weight", (h,), plain(f"{QKV}.layer_norm_weight", i)
        yield p + "ln_1.bias", (h,), plain(f"{QKV}.layer_norm_bias", i)
        yield p + "attn.c_attn.weight", (h, 3 * h), qkv(f"{QKV}.weight", i, transpose=True)
        yield p + "attn.c_attn.bias", (3 * h,), qkv(f"{QKV}.bias", i, transpose=False)
        yield p + "attn.c_proj.weight", (h, h), plain(f"{PROJ}.weight", i, transpose=True)
        yield p + "attn.c_proj.bias", (h,), plain(f"{PROJ}.bias", i)
        yield p + "ln_2.weight", (h,), plain(f"{FC1}.layer_norm_weight", i)
        yield p + "ln_2.bias", (h,), plain(f"{FC1}.layer_norm_bias", i)
        yield p + "mlp.c_fc.weight", (h, ffn), plain(f"{FC1}.weight", i, transpose=True)
        yield p + "mlp.c_fc.bias", (ffn,), plain(f"{FC1}.bias", i)
        yield p + "mlp.c_proj.weight", (ffn, h), plain(f"{FC2}.weight", i, transpose=True)
        yield p + "mlp.c_proj.bias", (h,), plain(f"{FC2}.bias", i)
    yield "transformer.ln_f.weight", (h,), plain("decoder.final_layernorm.weight")
    yield "transformer.ln_f.bias", (h,), plain("decoder.final_layernorm.bias")
