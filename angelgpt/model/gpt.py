"""Megatron-core GPTModel from an angelgpt Config.

The layer spec is Megatron's local spec with angelgpt's SDPA core attention (CPU and GPU; what
model.transformer_impl 'auto' and 'local' build), or Megatron's transformer-engine spec when
model.transformer_impl is 'transformer_engine' (GPU only, an explicit opt-in that angelgpt's tests
have not run).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

from angelgpt.config import Config, ConfigError


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU's tanh approximation: OpenAI's GPT-2 MLP (transformers' gelu_new), model.openai_gelu."""
    return F.gelu(x, approximate="tanh")


def have_transformer_engine() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except Exception:
        return False
    return True


def use_transformer_engine(cfg: Config, on_gpu: bool) -> bool:
    """Only when model.transformer_impl is 'transformer_engine' (and it imports on this GPU)."""
    impl = cfg.model.transformer_impl
    if impl == "transformer_engine":
        if not (on_gpu and have_transformer_engine()):
            raise ConfigError("model.transformer_impl is 'transformer_engine' but transformer-engine does not "
                              "import here (it needs CUDA and `pip install angelgpt[te]`)")
        return True
    return False  # 'local', and 'auto', which angelgpt.planner.resolve_config makes 'local' first


def transformer_config(cfg: Config, on_gpu: bool, perform_initialization: bool = True) -> TransformerConfig:
    m = cfg.model
    recompute = m.recompute == "full"
    return TransformerConfig(
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        num_attention_heads=m.num_attention_heads,
        num_query_groups=m.num_query_groups,
        kv_channels=m.kv_channels,
        ffn_hidden_size=m.ffn_hidden_size,
        gated_linear_unit=m.swiglu,
        activation_func=F.silu if m.swiglu else gelu_tanh if m.openai_gelu else F.gelu,
        normalization=m.normalization,
        layernorm_epsilon=m.norm_epsilon,
        add_bias_linear=m.add_bias_linear,
        add_qkv_bias=m.add_qkv_bias,
        hidden_dropout=m.hidden_dropout,
        attention_dropout=m.attention_dropout,
        init_method_std=m.init_method_std,
        tensor_model_parallel_size=cfg.parallel.tensor_model_parallel_size,
        sequence_parallel=sequence_parallel(cfg),
        pipeline_model_parallel_size=cfg.parallel.pipeline_model_parallel_size,
        pipeline_dtype=torch.bfloat16 if on_gpu else torch.float32,
        params_dtype=torch.bfloat16 if on_gpu else torch.float32,
        bf16=on_gpu,
        # Megatron's "CPU initialization" draws each full (unsplit) weight and keeps the rank's slice, so
        # every TP size starts from the same model; angelgpt's local spec draws it on the device the
        # model is built on (build_gpt), from the layer's own seed. Transformer-engine's spec initialises
        # each rank's shard in place (Megatron's RNG tracker).
        use_cpu_initialization=not use_transformer_engine(cfg, on_gpu),
        perform_initialization=perform_initialization,
        gradient_accumulation_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        # on CPU the pipeline's P2P is one gloo isend/irecv per tensor (angelgpt.parallel.cpu_schedules)
        batch_p2p_comm=on_gpu,
        # every layer: one at a time ('uniform', 1); the first k of each stage: 'block', k
        recompute_granularity="full" if recompute else None,
        recompute_method=("uniform" if m.recompute_num_layers is None else "block") if recompute else None,
        recompute_num_layers=(m.recompute_num_layers or 1) if recompute else None,
    )


def _seeded_layer(seed: int):
    """Megatron's TransformerLayer that seeds the RNG (CPU and GPU generators) from (seed, global layer
    number) before drawing its weights: a layer starts the same whatever pipeline stage builds it, and
    whether it is built with the model or later (deferred); the first stage's embeddings draw from the
    seed the worker set, the last stage's output layer after the last layer."""
    from megatron.core.transformer.transformer_layer import TransformerLayer, get_transformer_layer_offset

    class SeededTransformerLayer(TransformerLayer):
        def __init__(self, config, submodules, layer_number: int = 1, *args, **kwargs):
            global_number = layer_number + get_transformer_layer_offset(config, kwargs.get("vp_stage"))
            torch.manual_seed(seed * 1_000_003 + global_number)
            super().__init__(config, submodules, layer_number, *args, **kwargs)

    return SeededTransformerLayer


def sequence_parallel(cfg: Config) -> bool:
    """parallel.sequence_parallel as the model is built: only with TP > 1 (resolve_config turns it off at
    TP 1, with a notice)."""
    return cfg.parallel.sequence_parallel and cfg.parallel.tensor_model_parallel_size > 1


def _block_spec(cfg: Config, on_gpu: bool, layer: ModuleSpec, norm) -> ModuleSpec:
    """The local layer spec inside a block spec whose norms, the layers' two and the final one, are
    `norm` (TransformerBlock builds its final norm from Megatron's own choice unless a block spec names
    one, and that choice, apex's FusedLayerNorm where apex is installed, has no RMSNorm)."""
    from megatron.core.transformer.transformer_block import (
        TransformerBlock,
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )

    layer.submodules.input_layernorm = layer.submodules.pre_mlp_layernorm = norm
    layers = get_num_layers_to_build(transformer_config(cfg, on_gpu))
    return ModuleSpec(module=TransformerBlock, submodules=TransformerBlockSubmodules(
        layer_specs=[layer] * layers, layer_norm=norm))


def _sequence_parallel_block(cfg: Config, on_gpu: bool, layer: ModuleSpec) -> ModuleSpec:
    """The local layer spec inside a block spec whose norms run on the local slice of the sequence:
    angelgpt's SequenceParallelNorm (Megatron's local norm refuses sequence_parallel). On CPU the
    embedding's dropout under sequence parallelism forks Megatron's CUDA RNG tracker: there it is a
    tracker whose fork changes nothing (the dropout draws from the CPU generator, as every other dropout
    on CPU does)."""
    from megatron.core import tensor_parallel

    from angelgpt.model.norm import SequenceParallelNorm

    if not on_gpu:
        tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    return _block_spec(cfg, on_gpu, layer, SequenceParallelNorm)


def layer_spec(cfg: Config, on_gpu: bool, defer_layers: bool = False) -> ModuleSpec:
    from megatron.core.models.gpt import gpt_layer_specs

    if use_transformer_engine(cfg, on_gpu):
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec()
    from angelgpt.model.attention import SDPAttention

    spec = gpt_layer_specs.get_gpt_layer_local_spec(normalization=cfg.model.normalization)
    spec.submodules.self_attention.submodules.core_attention = SDPAttention
    spec.module = _seeded_layer(cfg.train.seed)
    if defer_layers:
        from angelgpt.model.deferred import deferred_layer

        spec.module = deferred_layer(spec.module)
    if sequence_parallel(cfg):
        spec = _sequence_parallel_block(cfg, on_gpu, spec)
    elif cfg.model.normalization == "RMSNorm":
        from megatron.core.transformer.torch_norm import WrappedTorchNorm

        spec = _block_spec(cfg, on_gpu, spec, WrappedTorchNorm)
    return spec


def build_gpt(cfg: Config, on_gpu: bool, perform_initialization: bool = True, defer_layers: bool = False) -> GPTModel:
    """Builds this rank's pipeline stage of the GPT; Megatron parallel_state must be initialised.

    defer_layers: the transformer layers are built on the meta device, to be materialized one at a
    time by whoever places their weights (angelgpt.model.deferred; ZeRO-Cache's store). Not with the
    transformer-engine spec.

    Every TP and PP layout, and a deferred build as an ordinary one, starts from the same weights (on
    the CPU and, drawn by the GPU's generator, on a GPU; with the local spec): each TP shard is cut from
    full weights drawn on one RNG stream, each layer's stream is seeded by its global number, an untied
    output layer's by num_layers + 1, and the last stage's copy of tied embeddings is the first stage's
    (Megatron's all-reduce, its `.cuda()` kept on the CPU); the RNG is then reseeded alike on every
    rank."""
    from angelgpt.parallel.cpu_schedules import on_cpu

    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else None
    with device if on_gpu else on_cpu():  # on a GPU the full weights are drawn there
        model = _gpt_model(cfg, on_gpu, perform_initialization, defer_layers)
        if perform_initialization:
            _seed_output_layer(model, cfg)
    if not on_gpu:
        _rope_on_cpu(model)
    torch.manual_seed(cfg.train.seed + 1)
    if on_gpu:
        _to_device(model, device)
    return model


def _to_device(model: torch.nn.Module, device: torch.device) -> None:
    """The model's parameters and buffers moved to `device` in place (each parameter stays the same
    object, with the attributes Megatron set on it), except a deferred layer's, which stay on 'meta'."""
    for module in model.modules():
        for param in module.parameters(recurse=False):
            if not param.is_meta:
                param.data = param.data.to(device)
        for name, buffer in module.named_buffers(recurse=False):
            if not buffer.is_meta:
                setattr(module, name, buffer.to(device))


class CPURotaryEmbedding(RotaryEmbedding):
    """Megatron's RotaryEmbedding in a model built for the CPU. Megatron keeps the inverse frequencies (a
    plain fp32 attribute, not a buffer) on the CPU when the config says use_cpu_initialization and moves
    them to torch.cuda.current_device() on the first forward; here that move runs under
    angelgpt.parallel.cpu_schedules.on_cpu(), which keeps them where they are, and moving the model
    (``model.to(device)``, as generate and eval do to run on a GPU) moves them with it, in fp32 whatever
    dtype the model is cast to. Everything else (the frequencies, rotary_percent, the cache of the
    embedding's outputs) is Megatron's."""

    def get_emb(self, max_seq_len: int, offset: int = 0):
        if self.inv_freq.device.type != "cpu":
            return super().get_emb(max_seq_len, offset)
        from angelgpt.parallel.cpu_schedules import on_cpu

        with on_cpu():
            return super().get_emb(max_seq_len, offset)

    def _apply(self, fn, recurse=True):
        self.inv_freq = self.inv_freq.to(fn(self.inv_freq).device)
        return super()._apply(fn, recurse)


def _rope_on_cpu(model: GPTModel) -> None:
    """The model's RotaryEmbedding (RoPE) made a CPURotaryEmbedding (the same object, its class swapped)."""
    rotary = getattr(model, "rotary_pos_emb", None)
    if type(rotary) is RotaryEmbedding:
        rotary.__class__ = CPURotaryEmbedding


def _seed_output_layer(model: GPTModel, cfg: Config) -> None:
    """An untied output layer's weight drawn from its own seed (seed, num_layers + 1) as the full
    [padded vocabulary, hidden] weight, with Megatron's init_method, this TP rank's rows kept: the same
    at every TP and PP size, and whether the layers before it drew their weights (an ordinary build) or
    not (deferred layers, built on the meta device). A tied output layer is the input embedding's."""
    if not model.post_process or model.share_embeddings_and_output_weights:
        return
    weight = model.output_layer.weight
    tp = parallel_state.get_tensor_model_parallel_world_size()
    rank = parallel_state.get_tensor_model_parallel_rank()
    torch.manual_seed(cfg.train.seed * 1_000_003 + cfg.model.num_layers + 1)
    full = torch.empty(weight.shape[0] * tp, weight.shape[1], dtype=torch.float32)
    model.config.init_method(full)
    with torch.no_grad():
        weight.copy_(full.chunk(tp)[rank])


def _gpt_model(cfg: Config, on_gpu: bool, perform_initialization: bool, defer_layers: bool = False) -> GPTModel:
    if defer_layers and use_transformer_engine(cfg, on_gpu):
        raise ConfigError("deferred layer init is not offered with model.transformer_impl 'transformer_engine'")
    return GPTModel(
        config=transformer_config(cfg, on_gpu, perform_initialization),
        transformer_layer_spec=layer_spec(cfg, on_gpu, defer_layers),
        vocab_size=cfg.padded_vocab_size(),
        max_sequence_length=cfg.model.seq_length,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=not cfg.model.untie_embeddings_and_output_weights,
        position_embedding_type=cfg.model.position_embedding_type,
        rotary_percent=cfg.model.rotary_percent,
        rotary_base=cfg.model.rotary_base,
    )
