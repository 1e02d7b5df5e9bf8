"""A local Hugging Face transformers model as an angelgpt checkpoint at iteration 0 (``angelgpt import``).

    from angelgpt.export.hf_import import import_hf
    summary = import_hf("models/llama", "runs/ck")     # writes runs/ck/iter_0000000 and runs/ck/config.yaml

``LlamaForCausalLM`` (Llama, Mistral without a sliding window), ``Qwen2ForCausalLM`` (its q, k, v biases:
``model.add_qkv_bias``) and ``GPT2LMHeadModel`` are read. The
architecture implies the model section of the config (RMSNorm, SwiGLU, RoPE, grouped-query attention,
untied output weights for Llama; GPT-2's LayerNorm, GELU exact or tanh-approximated, learned positions,
tied weights), and
``data.tokenizer`` is the model directory when it holds a tokenizer. angelgpt's GPT is built on CPU at
TP 1, PP 1, fp32, each safetensors tensor read alone (``safe_open``) and copied in (q/k/v fused into
Megatron's per-query-group ``linear_qkv``, gate and up into ``linear_fc1``, the vocabulary padded with
zero rows to Megatron's padded size), and saved through Megatron dist_checkpointing as a model-only
checkpoint: ``train --load`` takes its weights and starts the optimizer and schedule fresh.

What the model cannot express is refused in one line before anything is written: sliding-window
attention, rope_scaling, mixture of experts, activations other than SiLU (Llama) or GELU (GPT-2),
attention biases without MLP biases (or the reverse), weights not in safetensors, a tokenizer with more
tokens than the model's vocabulary, and a --save that already holds a checkpoint.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Dict, Iterator, Tuple

import torch

from angelgpt.config import ConfigError

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "GPT2LMHeadModel")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


def _hf_config(hf_dir: str) -> dict:
    path = Path(hf_dir)
    if not path.is_dir():
        raise ConfigError(f"--hf {hf_dir} is not a directory")
    try:
        hf = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        raise ConfigError(f"--hf {hf_dir} is not a transformers model directory: no config.json that parses") from None
    arch = (hf.get("architectures") or [None])[0]
    if arch not in ARCHITECTURES:
        raise ConfigError(f"--hf {hf_dir} is a {arch or hf.get('model_type', 'model of unknown architecture')}; "
                          f"angelgpt imports {', '.join(ARCHITECTURES)}")
    return hf


def _rope(hf: dict) -> Tuple[dict, float]:
    """(rope_scaling, rope_theta) from transformers 4's fields or 5's rope_parameters."""
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or ({} if params.get("rope_type", "default") == "default" else params)
    return scaling, float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))


def _llama_model(hf: dict, hf_dir: str) -> dict:
    why = None
    scaling, theta = _rope(hf)
    heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    qwen2 = hf["architectures"][0] == "Qwen2ForCausalLM"  # q, k, v biases; none in o_proj and the MLP
    attention_bias, mlp_bias = bool(hf.get("attention_bias")), bool(hf.get("mlp_bias"))
    if hf.get("sliding_window") is not None and hf.get("use_sliding_window", True):
        why = f"it uses sliding-window attention ({hf['sliding_window']} tokens)"
    elif scaling:
        why = f"it scales RoPE ({scaling.get('rope_type') or scaling.get('type')}); only unscaled RoPE is imported"
    elif any(k in hf for k in ("num_local_experts", "num_experts", "n_routed_experts")):
        why = "it is a mixture of experts"
    elif hf.get("hidden_act", "silu") != "silu":
        why = f"its MLP activation is {hf['hidden_act']} (angelgpt's SwiGLU is SiLU-gated)"
    elif attention_bias != mlp_bias:
        why = (f"attention_bias={attention_bias} but mlp_bias={mlp_bias} (angelgpt's linears all have biases "
               f"or none: model.add_bias_linear)")
    elif theta != int(theta):
        why = f"its rope_theta {theta} is not an integer (model.rotary_base)"
    if why:
        raise ConfigError(f"--hf {hf_dir} cannot be imported: {why}")
    return dict(num_layers=hf["num_hidden_layers"], hidden_size=hf["hidden_size"], num_attention_heads=heads,
                num_query_groups=hf.get("num_key_value_heads") or heads, kv_channels=head_dim,
                ffn_hidden_size=hf["intermediate_size"], swiglu=True, normalization="RMSNorm",
                norm_epsilon=float(hf.get("rms_norm_eps", 1e-6)), add_bias_linear=attention_bias, add_qkv_bias=qwen2,
                position_embedding_type="rope", rotary_base=int(theta),
                untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", False),
                seq_length=min(int(hf.get("max_position_embeddings", 2048)), 4096), vocab_size=hf["vocab_size"],
                init_method_std=float(hf.get("initializer_range", 0.02)))


# transformers' GPT-2 activations angelgpt computes, and whether each is model.openai_gelu (the tanh
# approximation, OpenAI's checkpoints) or the exact GELU
GPT2_ACTIVATIONS = {"gelu": False, "gelu_new": True, "gelu_pytorch_tanh": True}


def _gpt2_model(hf: dict, hf_dir: str) -> dict:
    why = None
    activation = hf.get("activation_function", "gelu_new")  # GPT2Config's default
    if activation not in GPT2_ACTIVATIONS:
        why = (f"its activation is {activation}; angelgpt's GPT-2 MLP computes "
               f"{' or '.join(repr(a) for a in GPT2_ACTIVATIONS)}")
    elif hf.get("scale_attn_by_inverse_layer_idx") or hf.get("reorder_and_upcast_attn"):
        why = "it scales attention by the inverse layer index or reorders it (angelgpt's attention is plain)"
    elif hf.get("add_cross_attention"):
        why = "it has cross-attention"
    elif hf.get("tie_word_embeddings", True) is False:
        why = "its output weights are untied (GPT-2's are tied to the input embedding)"
    if why:
        raise ConfigError(f"--hf {hf_dir} cannot be imported: {why}")
    h = hf["n_embd"]
    return dict(num_layers=hf["n_layer"], hidden_size=h, num_attention_heads=hf["n_head"],
                num_query_groups=hf["n_head"], kv_channels=h // hf["n_head"],
                ffn_hidden_size=hf.get("n_inner") or 4 * h, norm_epsilon=float(hf.get("layer_norm_epsilon", 1e-5)),
                seq_length=hf["n_positions"], vocab_size=hf["vocab_size"], openai_gelu=GPT2_ACTIVATIONS[activation],
                init_method_std=float(hf.get("initializer_range", 0.02)))


def vocab_divisor(vocab: int) -> int:
    """model.make_vocab_size_divisible_by D that pads the vocabulary to the same P rows at TP 1, 2, 4
    and 8 (Megatron pads to a multiple of D x TP), so that the checkpoint trains at any of them: P = 8 D,
    the least multiple of some g in 1024 ... 128 (the larger g on a tie; 64 ... 8 for tiny vocabularies)
    for which no TP up to 8 pads past P (P - D < vocab)."""
    for sizes in ((1024, 512, 256, 128), (64, 32, 16, 8)):
        fits = [-(-vocab // g) * g for g in sizes if -(-vocab // g) * g * 7 // 8 < vocab]
        if fits:
            return min(fits) // 8
    return max(1, -(-vocab // 8))


def implied_config(hf_dir: str) -> Tuple[str, dict]:
    """(architecture, the config YAML's sections: model, and data.tokenizer when the directory has one);
    ConfigError when the directory is not an importable transformers model or its tokenizer does not fit."""
    hf = _hf_config(hf_dir)
    arch = hf["architectures"][0]
    model = _gpt2_model(hf, hf_dir) if arch == "GPT2LMHeadModel" else _llama_model(hf, hf_dir)
    model["make_vocab_size_divisible_by"] = vocab_divisor(model["vocab_size"])
    raw = {"model": model}
    if any((Path(hf_dir) / f).is_file() for f in TOKENIZER_FILES):
        from angelgpt.data.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(str(Path(hf_dir).resolve()))
        if tokenizer.vocab_size > model["vocab_size"]:
            raise ConfigError(f"--hf {hf_dir}: its tokenizer has {tokenizer.vocab_size} tokens but the model's "
                              f"vocabulary is {model['vocab_size']}")
        raw["data"] = {"tokenizer": str(Path(hf_dir).resolve())}
    _weight_files(hf_dir)
    return arch, raw


def _weight_files(hf_dir: str) -> list:
    path = Path(hf_dir)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [path / n for n in names]
    else:
        files = [path / "model.safetensors"]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise ConfigError(f"--hf {hf_dir} has no {missing[0]} (angelgpt imports safetensors weights)")
    return files


def hf_tensors(hf_dir: str) -> Iterator[Tuple[str, torch.Tensor]]:
    """(name, tensor) of every stored tensor, one at a time, shard after shard (safe_open reads each
    tensor when asked for it)."""
    from safetensors import safe_open

    for f in _weight_files(hf_dir):
        with safe_open(str(f), framework="pt") as shard:
            for name in shard.keys():
                yield name, shard.get_tensor(name)


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: int, head_dim: int) -> torch.Tensor:
    """transformers' separate q, k, v rows to Megatron's linear_qkv rows, interleaved by query group:
    [q heads of group 0, k0, v0, q heads of group 1, ...] (weights [rows, in] and biases [rows])."""
    rest = q.shape[1:]
    return torch.cat([q.reshape(groups, -1, *rest), k.reshape(groups, head_dim, *rest),
                      v.reshape(groups, head_dim, *rest)], dim=1).reshape(-1, *rest)


def _llama_target(name: str) -> Tuple[str, str]:
    """(the model's state-dict key, the part of it) of a Llama tensor name, or ('', '') to skip it."""
    if name == "model.embed_tokens.weight":
        return "embedding.word_embeddings.weight", "vocab"
    if name == "lm_head.weight":
        return "output_layer.weight", "vocab"
    if name == "model.norm.weight":
        return "decoder.final_layernorm.weight", ""
    parts = name.split(".")
    if parts[:2] != ["model", "layers"]:
        return "", ""
    p, rest = f"decoder.layers.{parts[2]}.", ".".join(parts[3:])
    simple = {"input_layernorm.weight": "input_layernorm.weight",
              "post_attention_layernorm.weight": "pre_mlp_layernorm.weight",
              "self_attn.o_proj.weight": "self_attention.linear_proj.weight",
              "self_attn.o_proj.bias": "self_attention.linear_proj.bias",
              "mlp.down_proj.weight": "mlp.linear_fc2.weight", "mlp.down_proj.bias": "mlp.linear_fc2.bias"}
    if rest in simple:
        return p + simple[rest], ""
    module, _, kind = rest.rpartition(".")
    if module in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"):
        return p + f"self_attention.linear_qkv.{kind}", module[-6]
    if module in ("mlp.gate_proj", "mlp.up_proj"):
        return p + f"mlp.linear_fc1.{kind}", module[4:-5]
    return "", ""


def _gpt2_target(name: str) -> Tuple[str, str]:
    name = name[len("transformer."):] if name.startswith("transformer.") else name
    if name == "wte.weight":
        return "embedding.word_embeddings.weight", "vocab"
    if name == "wpe.weight":
        return "embedding.position_embeddings.weight", ""
    if name.startswith("ln_f."):
        return "decoder.final_layernorm." + name[5:], ""
    parts = name.split(".")
    if parts[0] != "h":
        return "", ""  # lm_head (tied), attention masks of old checkpoints
    p, rest = f"decoder.layers.{parts[1]}.", ".".join(parts[2:])
    table = {"ln_1": ("input_layernorm", ""), "ln_2": ("pre_mlp_layernorm", ""),
             "attn.c_attn": ("self_attention.linear_qkv", "qkv"), "attn.c_proj": ("self_attention.linear_proj", "T"),
             "mlp.c_fc": ("mlp.linear_fc1", "T"), "mlp.c_proj": ("mlp.linear_fc2", "T")}
    module, _, kind = rest.rpartition(".")
    if module not in table:
        return "", ""
    target, how = table[module]
    return f"{p}{target}.{kind}", how if kind == "weight" or how == "qkv" else ""


def copy_weights(model, arch: str, hf_dir: str, m) -> int:
    """Copies every tensor of the directory into the (TP 1, PP 1) model; returns how many model
    tensors were filled. ConfigError when a model tensor is left unfilled or a shape does not fit."""
    params: Dict[str, torch.Tensor] = {k: v for k, v in model.state_dict(keep_vars=True).items()
                                       if isinstance(v, torch.Tensor)}
    groups, d = m.num_query_groups, m.kv_channels
    pending: Dict[str, Dict[str, torch.Tensor]] = {}  # q/k/v, gate/up until all parts are read
    filled = set()
    target_of = _gpt2_target if arch == "GPT2LMHeadModel" else _llama_target

    def put(key: str, t: torch.Tensor) -> None:
        dst = params.get(key)
        if dst is None or (dst.shape != t.shape and not (dst.dim() == 2 and dst.shape[1:] == t.shape[1:]
                                                         and dst.shape[0] >= t.shape[0])):
            raise ConfigError(f"--hf {hf_dir}: {key} is {tuple(t.shape)}, angelgpt's is "
                              f"{None if dst is None else tuple(dst.shape)}")
        with torch.no_grad():
            dst.zero_()
            dst[:t.shape[0]].copy_(t)  # a vocabulary's padding rows stay zero
        filled.add(key)

    for name, t in hf_tensors(hf_dir):
        key, how = target_of(name)
        if not key or (key == "output_layer.weight" and not m.untie_embeddings_and_output_weights):
            continue  # (a tied lm_head some directories store beside the embedding)
        t = t.float()
        if how == "T":
            t = t.t()
        elif how == "qkv":  # GPT-2's Conv1D [in, 3h] as [all q, all k, all v]
            t = t.t() if t.dim() == 2 else t
            q, k, v = t.chunk(3, dim=0)
            t = fuse_qkv(q, k, v, groups, d)
        if how in ("q", "k", "v", "gate", "up"):
            parts = pending.setdefault(key, {})
            parts[how] = t
            if set(parts) == {"q", "k", "v"}:
                put(key, fuse_qkv(parts["q"], parts["k"], parts["v"], groups, d))
                del pending[key]
            elif set(parts) == {"gate", "up"}:
                put(key, torch.cat([parts["gate"], parts["up"]], dim=0))
                del pending[key]
        else:
            put(key, t)
    if not m.untie_embeddings_and_output_weights:
        filled.add("output_layer.weight")
    missing = sorted(k for k in params if k not in filled and not k.endswith("_extra_state"))
    if missing or pending:
        raise ConfigError(f"--hf {hf_dir} has no tensor for angelgpt's {(missing or sorted(pending))[0]}")
    return len(filled)


def import_hf(hf_dir: str, save: str) -> dict:
    """Writes the checkpoint and SAVE/config.yaml; returns {architecture, parameters, config, save}."""
    import yaml

    from angelgpt.config import parse, to_dict
    from angelgpt.export.local_model import single_process
    from angelgpt.model.gpt import build_gpt
    from angelgpt.train import checkpoint_check
    from angelgpt.train.checkpoint import save_model_only

    out = Path(save)
    if out.exists() and (not out.is_dir() or checkpoint_check.iterations(out) or (out / checkpoint_check.TRACKER)
                         .exists() or (out / "config.yaml").exists()):
        raise ConfigError(f"--save {save} already holds a checkpoint or a file: import into a new directory")
    arch, raw = implied_config(hf_dir)
    cfg_file, created = out / "config.yaml", not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    cfg_file.write_text(yaml.safe_dump(raw, sort_keys=False))
    try:
        cfg = parse(None, str(cfg_file), ["train.device=cpu", "model.transformer_impl=local"])
        with single_process():
            model = build_gpt(cfg, on_gpu=False, perform_initialization=False)
            copy_weights(model, arch, hf_dir, cfg.model)
            save_model_only(save, model, to_dict(parse(None, str(cfg_file))))  # the config as implied
    except BaseException:
        cfg_file.unlink(missing_ok=True)
        if created:
            shutil.rmtree(out, ignore_errors=True)
        raise
    parameters = sum(p.numel() for p in model.parameters())
    return {"architecture": arch, "parameters": parameters, "config": raw, "save": str(out)}
