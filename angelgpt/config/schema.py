"""Configuration sections, one pydantic dataclass each, with a docstring under every field.

Two configs: `Config`, as parsed (a setting may be 'auto'), and `ResolvedConfig`, what the planner's
resolve_config returns and the worker reads, whose sections narrow every 'auto' field to its values
(Resolved*Config, no docstrings of their own). Construction checks each field against its annotation
(strictly: no string becomes an int or a bool; an int is taken for a float); a section's
``__post_init__`` checks what its types cannot, and ``Config.__post_init__`` what spans sections.
The loader turns a refusal into ``ConfigError``, one line naming the key, the value and what is allowed.
"""

from __future__ import annotations

import os
import typing
from dataclasses import field, fields
from typing import Annotated, List, Literal, Optional, Union

from pydantic import BeforeValidator, ConfigDict
from pydantic.dataclasses import dataclass

from angelgpt.config import optimizers
from angelgpt.config.errors import ConfigError


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def _yaml_float(value):
    """YAML 1.1 reads a number with an exponent and no dot (1e-4) as a string: such a string is its float."""
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            pass
    return value


# a float field: an int is taken too (strict mode), and YAML 1.1's string for 1e-4
Float = Annotated[float, BeforeValidator(_yaml_float)]
Auto = Literal["auto"]
# the values of the settings that may be 'auto' (a ResolvedConfig holds one of these)
Recompute = Literal["none", "full"]
ActivationOffload = Literal["none", "checkpoints"]
TransformerImpl = Literal["local", "transformer_engine"]
CpuAdam = Literal["native", "torch"]
Device = Literal["cpu", "cuda"]
# the dtypes ZeRO-Cache keeps Adam's moments in (optim.exp_avg_dtype, optim.exp_avg_sq_dtype)
MomentDtype = Literal["fp32", "bf16", "fp8"]
# the largest adam_beta2 a bf16 exp_avg_sq takes: its decay of 1 - beta2 a step must stay clear of half
# a bf16 step (2**-9 relative), where rounding to nearest would keep the moment where it is
BF16_EXP_AVG_SQ_MAX_BETA2 = 0.99

# every section: fields checked against their annotations at construction, defaults included
_CHECKED = ConfigDict(strict=True, allow_inf_nan=False, validate_default=True)
_section = dataclass(config=_CHECKED)


def type_text(tp) -> str:
    """An annotation in words, as errors and docs/config.md say it: `int or None`, `float or 'auto'`,
    `'none', 'full' or 'auto'`, `list of str`."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Annotated:
        return type_text(args[0])
    if origin is Literal:
        return _alternatives([repr(a) for a in args])
    if origin is Union:  # a Literal's values are alternatives of their own
        return _alternatives([word for arg in args for word in (
            [repr(a) for a in typing.get_args(arg)] if typing.get_origin(arg) is Literal else [type_text(arg)])])
    if origin is list:
        inner = type_text(args[0])
        return f"list of ({inner})" if " or " in inner else f"list of {inner}"
    return "None" if tp is type(None) else tp.__name__


def _alternatives(words: List[str]) -> str:
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} or {words[-1]}"


def is_choice(tp) -> bool:
    """The annotation allows listed values only (Literal, or Optional of one)."""
    args = typing.get_args(tp) if typing.get_origin(tp) is Union else (tp,)
    return all(a is type(None) or typing.get_origin(a) is Literal for a in args)


def _fraction(key: str, value) -> None:
    """A number in [0, 1] (or 'auto', which the type allows where it does)."""
    _require(value == "auto" or 0.0 <= value <= 1.0, f"{key} must be in [0, 1] or 'auto', got {value}")


def _importable(module: str) -> bool:
    """The module is installed (found, not imported)."""
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _start_end(key: str, value) -> List[int]:
    """[START, END] from "START,END" or a list of two ints, with END >= START >= 1."""
    parts = value.split(",") if isinstance(value, str) else value
    try:
        pair = [int(str(p).strip()) for p in parts]
    except ValueError:
        pair = []
    _require(len(pair) == 2 and all(not isinstance(p, (bool, float)) for p in parts)
             and 1 <= pair[0] <= pair[1],
             f"{key} must be START,END with END >= START >= 1 (iterations, inclusive), got '{value}'")
    return pair


def _positive(section: str, **values) -> None:
    for key, value in values.items():
        _require(value > 0, f"{section}.{key} must be > 0, got {value}")


@_section
class ModelConfig:
    num_layers: int = 2
    """Number of transformer layers."""
    hidden_size: int = 64
    """Transformer hidden size."""
    num_attention_heads: int = 4
    """Number of attention (query) heads."""
    num_query_groups: Optional[int] = None
    """Key/value head groups for grouped-query attention; None means one per head (MHA)."""
    kv_channels: Optional[int] = None
    """Attention head size; None means hidden_size / num_attention_heads (must divide)."""
    ffn_hidden_size: Optional[int] = None
    """MLP hidden size (with swiglu the width of the gate, and of the product it gates); None means
    4 * hidden_size, or with swiglu Megatron's default for it, 8/3 * hidden_size rounded down to a
    multiple of 64."""
    swiglu: bool = False
    """Gated SiLU MLP (Megatron's gated_linear_unit with activation_func silu): linear_fc1 makes
    2 * ffn_hidden_size outputs, silu(gate) * up, and linear_fc2 takes ffn_hidden_size back to
    hidden_size. False: GELU MLP (GPT-2)."""
    openai_gelu: bool = False
    """The GELU MLP with GELU's tanh approximation, as OpenAI's GPT-2 computes it (transformers'
    'gelu_new'; Megatron-LM's --openai-gelu). False: the exact GELU (transformers' 'gelu'). Not with
    swiglu."""
    normalization: Literal["LayerNorm", "RMSNorm"] = "LayerNorm"
    """'LayerNorm' (weight and bias, GPT-2) or 'RMSNorm' (weight only, Llama): the layers' two norms and
    the final one."""
    norm_epsilon: Float = 1e-5
    """Epsilon of every norm (Megatron's layernorm_epsilon)."""
    add_bias_linear: bool = True
    """Biases in the attention's and the MLP's linear layers (GPT-2); False: none (Llama)."""
    add_qkv_bias: bool = False
    """With add_bias_linear false: biases in the attention's query, key and value projection alone
    (linear_qkv; Qwen2's attention biases), Megatron's add_qkv_bias."""
    seq_length: int = 128
    """Training sequence length in tokens."""
    vocab_size: int = 50257
    """Tokenizer vocabulary size before padding (a real tokenizer's size overrides it)."""
    make_vocab_size_divisible_by: int = 128
    """Pad the vocabulary to a multiple of this times the tensor-parallel size, as Megatron does."""
    position_embedding_type: Literal["learned_absolute", "rope"] = "learned_absolute"
    """'learned_absolute' (GPT-2: a learned embedding per position) or 'rope' (rotary embeddings of
    queries and keys, Megatron's RotaryEmbedding; no parameters)."""
    rotary_base: int = 10000
    """RoPE's base period (Llama 3: 500000). Used only with position_embedding_type 'rope'."""
    rotary_percent: Float = 1.0
    """Fraction of each head's channels that RoPE rotates, in (0, 1]; kv_channels * rotary_percent
    (rounded down) must be even. Used only with position_embedding_type 'rope'."""
    untie_embeddings_and_output_weights: bool = False
    """Give the output layer its own weights instead of sharing the input embedding."""
    hidden_dropout: Float = 0.0
    """Dropout after attention and MLP."""
    attention_dropout: Float = 0.0
    """Dropout on attention probabilities."""
    init_method_std: Float = 0.02
    """Standard deviation of the normal weight initialisation."""
    recompute: Literal[Recompute, "auto"] = "none"
    """Activation recompute: 'none', 'full' (layers' activations are recomputed in backward, all of them
    or the first recompute_num_layers), or 'auto': the planner's choice at launch, none where the
    activations fit and that is faster, else full with as many layers keeping their activations as fit
    and pay (on CPU: none)."""
    recompute_num_layers: Optional[int] = None
    """With recompute 'full': how many layers of each pipeline stage (the first ones) recompute their
    activations in backward, Megatron's recompute_method 'block'; the others keep theirs. None: every
    layer (recompute_method 'uniform', one layer at a time). With 'auto' the planner sets it."""
    activation_offload: Literal[ActivationOffload, "auto"] = "auto"
    """Activation offload with recompute: 'checkpoints' moves the inputs that recompute keeps of each
    recomputed layer (what Megatron's checkpointing saves for its backward, 2*s*b*h bytes a layer, 1/TP
    with sequence parallelism) to pinned host memory during forward and brings each back for its
    layer's backward; needs model.recompute 'full' on GPU. 'none' keeps them on the GPU; 'auto': the
    planner's choice at launch, on where it is what fits or is faster (on CPU: none). On CPU, where
    recompute is not available, 'checkpoints' runs the same hooks over every tensor the forward saves
    (a copy in host memory, where it already was), so that the path is exercised there."""
    transformer_impl: Literal["auto", TransformerImpl] = "auto"
    """'local' (Megatron's local layers with angelgpt's scaled_dot_product_attention core attention: the
    tested path, on CPU and GPU), 'transformer_engine' (Megatron's transformer-engine spec; GPU only,
    needs `pip install angelgpt[te]`; an explicit opt-in that has not been run by angelgpt's tests) or
    'auto', which is 'local' everywhere, whether or not transformer-engine is installed."""

    def __post_init__(self):
        _positive("model", num_layers=self.num_layers, hidden_size=self.hidden_size,
                  num_attention_heads=self.num_attention_heads, seq_length=self.seq_length,
                  vocab_size=self.vocab_size, make_vocab_size_divisible_by=self.make_vocab_size_divisible_by)
        if self.kv_channels is None:
            _require(self.hidden_size % self.num_attention_heads == 0,
                     f"model.num_attention_heads ({self.num_attention_heads}) must divide model.hidden_size "
                     f"({self.hidden_size}) when model.kv_channels is not given")
            self.kv_channels = self.hidden_size // self.num_attention_heads
        _positive("model", kv_channels=self.kv_channels)
        if self.ffn_hidden_size is None:  # Megatron-LM's defaults
            self.ffn_hidden_size = int(8 * self.hidden_size / 3 / 64) * 64 if self.swiglu else 4 * self.hidden_size
        _positive("model", ffn_hidden_size=self.ffn_hidden_size)
        _require(not (self.openai_gelu and self.swiglu),
                 "model.openai_gelu sets the GELU MLP's activation: it does not go with model.swiglu")
        if self.num_query_groups is None:
            self.num_query_groups = self.num_attention_heads
        _require(self.num_query_groups > 0 and self.num_attention_heads % self.num_query_groups == 0,
                 f"model.num_query_groups ({self.num_query_groups}) must be > 0 and divide "
                 f"model.num_attention_heads ({self.num_attention_heads})")
        _positive("model", norm_epsilon=self.norm_epsilon, rotary_base=self.rotary_base)
        _require(0.0 < self.rotary_percent <= 1.0,
                 f"model.rotary_percent must be in (0, 1], got {self.rotary_percent}")
        rotary_dim = int(self.kv_channels * self.rotary_percent)
        _require(rotary_dim > 0 and rotary_dim % 2 == 0,
                 f"model.rotary_percent ({self.rotary_percent}) of model.kv_channels ({self.kv_channels}) "
                 f"must leave an even number of rotated channels > 0, got {rotary_dim}")
        if self.recompute_num_layers is not None:
            _require(self.recompute != "none",
                     "model.recompute_num_layers needs model.recompute 'full' (or 'auto'), got 'none'")
            _require(0 < self.recompute_num_layers <= self.num_layers,
                     f"model.recompute_num_layers must be in [1, num_layers={self.num_layers}], got "
                     f"{self.recompute_num_layers}")
        for key in ("hidden_dropout", "attention_dropout"):
            value = getattr(self, key)
            _require(0.0 <= value < 1.0, f"model.{key} must be in [0, 1), got {value}")
        _positive("model", init_method_std=self.init_method_std)


@_section
class ParallelConfig:
    tensor_model_parallel_size: int = 1
    """Tensor-parallel size (Megatron TP): splits attention heads and the MLP across ranks."""
    pipeline_model_parallel_size: int = 1
    """Pipeline-parallel size (Megatron PP): splits layers into stages; Megatron's 1F1B schedule (on CPU
    under angelgpt.parallel.cpu_schedules)."""
    distributed_timeout_minutes: Float = 10.0
    """Minutes a collective waits for the other ranks before this rank gives up, names itself, the
    collective's phase of training and the backend's report, and exits (a hung or lost rank)."""
    sequence_parallel: bool = False
    """Sequence parallelism (Megatron's): the layers' inputs, norms and dropout are split along the
    sequence across the tensor-parallel ranks (activations outside attention and the MLP 1/TP each);
    needs tensor_model_parallel_size to divide model.seq_length. With TP 1 it is turned off, with a
    one-line notice."""

    def __post_init__(self):
        _positive("parallel", tensor_model_parallel_size=self.tensor_model_parallel_size,
                  pipeline_model_parallel_size=self.pipeline_model_parallel_size)
        _require(self.distributed_timeout_minutes > 0,
                 f"parallel.distributed_timeout_minutes must be > 0, got {self.distributed_timeout_minutes}")


@_section
class OptimConfig:
    optimizer: str = "megatron"
    """'megatron' (Megatron's distributed optimizer), 'megatron_cpu_offload' (the same with Megatron's
    HybridDeviceOptimizer keeping offload_fraction of the states on the CPU; GPU only) or 'zero_cache'
    (GPU + CPU + NVMe state store); or an optimizer a module of custom_import registers
    (angelgpt.config.optimizers)."""
    custom_import: List[str] = field(default_factory=list)
    """Modules imported (by the launcher and by every worker) before optimizer is looked up, each of
    which may register an optimizer (angelgpt.config.optimizers.register; torchtitan's custom_import);
    importable from the workers' directory or PYTHONPATH, e.g. ['tests.toy_optimizer']."""
    offload_fraction: Float = 1.0
    """With 'megatron_cpu_offload': fraction of the optimizer states Megatron offloads to the CPU."""
    lr: Float = 3.0e-4
    """Peak learning rate."""
    min_lr: Float = 3.0e-5
    """Learning rate at the end of the decay."""
    lr_warmup_iters: int = 0
    """Iterations of linear warmup from 0 to lr."""
    lr_decay_style: Literal["cosine", "linear", "constant"] = "cosine"
    """'cosine', 'linear' or 'constant' decay after warmup."""
    lr_decay_iters: Optional[int] = None
    """Iterations over which lr decays to min_lr; None means train.train_iters."""
    weight_decay: Float = 0.1
    """Decoupled (AdamW) weight decay; biases and norm weights get none."""
    adam_beta1: Float = 0.9
    """Adam beta1."""
    adam_beta2: Float = 0.95
    """Adam beta2."""
    adam_eps: Float = 1.0e-8
    """Adam epsilon."""
    clip_grad: Float = 1.0
    """Clip the global gradient norm (over all ranks) to this; 0 disables clipping."""
    accumulate_grads_in_fp32: bool = True
    """Add up the micro batches' gradients of a step in fp32 (Megatron's
    --accumulate-allreduce-grads-in-fp32, DDP grad_reduce_in_fp32), for every optimizer: Megatron's
    gradient buffer (main_grad) is fp32; ZeRO-Cache adds each micro batch's gradient into an fp32
    main_grad per parameter on the GPU, or into fp32 gradient buffers and accumulation slots in the
    store (zero_cache.accumulate_in_store), and its AdamW reads the fp32 sum. With one micro batch per
    step nothing adds up, and ZeRO-Cache keeps its gradients in the model's dtype (its reduction over
    DP is fp32 either way). false: gradients add up in the model's dtype (bf16 on GPU): half the
    gradient bytes, but the rounding error grows with the number of micro batches. On CPU the model is
    fp32 and both are the same."""
    store_param_remainders: Union[bool, Auto] = "auto"
    """ZeRO-Cache keeps each fp32 master weight as the bf16 weight plus a 16-bit remainder (Megatron's
    and Transformer Engine's name): the exact fp32 master in 4 bytes instead of 6, 2 bytes a parameter
    less. The weight is the master rounded to nearest with ties away from zero (a 16-bit remainder
    cannot undo ties to even), so it differs from the fp32 path's bf16 weight by one bf16 step at
    exact ties only; the master is the same. Only for a bf16 model (a GPU run); Megatron's optimizers
    refuse it. 'auto' (the default, as Megatron's): on for ZeRO-Cache on a GPU, off otherwise (Megatron's
    optimizers; a CPU run's fp32 model, whose weight is its master); false keeps a separate fp32 master."""
    exp_avg_dtype: MomentDtype = "fp32"
    """dtype ZeRO-Cache keeps Adam's first moment in (Megatron's exp_avg_dtype): 'fp32'; 'bf16' (2 bytes
    a parameter less; rounded to nearest on every write); or 'fp8' (3 bytes less: E4M3 with an fp32
    power-of-two scale per block of 256, rounded stochastically on every write). The update itself runs
    in fp32."""
    exp_avg_sq_dtype: MomentDtype = "fp32"
    """dtype ZeRO-Cache keeps Adam's second moment in (Megatron's exp_avg_sq_dtype): 'fp32'; 'bf16'
    (with adam_beta2 <= 0.99 only: a bf16 moment cannot take a smaller decay a step); or 'fp8' (its
    square root in E4M3 with a scale per block of 256, rounded stochastically, so any beta2)."""

    def __post_init__(self):
        optimizers.import_custom(self.custom_import)
        spec = optimizers.get(self.optimizer)
        # a bf16 value moves only by more than half its step (2**-9 of it): with beta2 near 1 the second
        # moment's decay (1 - beta2 of it a step) would round away and the moment would stop shrinking
        _require(self.exp_avg_sq_dtype != "bf16" or self.adam_beta2 <= BF16_EXP_AVG_SQ_MAX_BETA2,
                 f"optim.exp_avg_sq_dtype 'bf16' needs optim.adam_beta2 <= {BF16_EXP_AVG_SQ_MAX_BETA2} (a bf16 "
                 f"moment cannot take the smaller decay of beta2 {self.adam_beta2}: it rounds away); use 'fp32'")
        compact = [k for k, v in (("store_param_remainders", self.store_param_remainders is True),
                                  ("exp_avg_dtype", self.exp_avg_dtype != "fp32"),
                                  ("exp_avg_sq_dtype", self.exp_avg_sq_dtype != "fp32")) if v]
        honouring = " or ".join(repr(n) for n in optimizers.names() if optimizers.get(n).supports_compact_states)
        _require(not compact or spec.supports_compact_states,
                 f"optim.{compact[0] if compact else ''} is honoured by optim.optimizer {honouring} only "
                 f"(Megatron's optimizers keep fp32 master weights and moments without transformer-engine); "
                 f"got optimizer '{self.optimizer}'")
        _require(0.0 <= self.offload_fraction <= 1.0,
                 f"optim.offload_fraction must be in [0, 1], got {self.offload_fraction}")
        _positive("optim", lr=self.lr, adam_eps=self.adam_eps)
        _require(0.0 <= self.min_lr <= self.lr, f"optim.min_lr must be in [0, lr={self.lr}], got {self.min_lr}")
        _require(self.lr_warmup_iters >= 0, f"optim.lr_warmup_iters must be >= 0, got {self.lr_warmup_iters}")
        _require(self.lr_decay_iters is None or self.lr_decay_iters > 0,
                 f"optim.lr_decay_iters must be > 0, got {self.lr_decay_iters}")
        for key in ("adam_beta1", "adam_beta2"):
            value = getattr(self, key)
            _require(0.0 <= value < 1.0, f"optim.{key} must be in [0, 1), got {value}")
        _require(self.weight_decay >= 0.0, f"optim.weight_decay must be >= 0, got {self.weight_decay}")
        _require(self.clip_grad >= 0.0, f"optim.clip_grad must be >= 0, got {self.clip_grad}")

    @property
    def spec(self) -> optimizers.OptimizerSpec:
        """The registered spec of `optimizer` (angelgpt.config.optimizers): what the rest asks of it."""
        return optimizers.get(self.optimizer)


@_section
class ZeroCacheConfig:
    pipeline_optimizer: bool = True
    """Pipeline the optimizer update with gradient offload and parameter upload."""
    prefetch_cache_sub_group_rate: Union[Float, Auto] = 0.0
    """Fraction of model states kept on GPU (0.0 to 1.0), or 'auto' to take the planner's choice."""
    offload_params: Union[bool, Auto] = "auto"
    """Keep the model-dtype weights of layers whose states are off the GPU in pinned host memory and
    fetch each layer just before it runs, releasing it after (ZeRO-3 parameter offload, prefetching the
    next layer); 'auto' turns it on with full activation recompute, which is when it saves GPU memory;
    when several micro batches accumulate in the store (each would fetch the weights again), only if the
    planner finds the weights do not fit on the GPU."""
    accumulate_in_store: Union[bool, Auto] = "auto"
    """Reduce every micro batch's gradients to their owner and add them up in the store's gradient
    buffers (device or pinned host), so the GPU holds only the gradients in flight rather than every
    gradient until the last micro batch; after the first micro batch a host chunk's running sum makes a
    round trip over PCIe (up to a device slot, add, back down) per micro batch. 'auto': on a GPU, the
    planner's choice (the faster of the two that fit); on CPU, off."""
    device_update_fraction: Union[Float, Auto] = "auto"
    """Fraction (0.0 to 1.0) of the host-resident states that the GPU updates instead of the CPU: their
    fp32 states and gradients stream up, fused AdamW runs on the device, the new weights go straight
    into the model and the states stream back, while the CPU updates the rest at the same time.
    'auto' splits by the rates of the two paths (PCIe against the CPU update) so both finish
    together; 0.0 leaves every host update to the CPU. Pins those states in host memory."""
    cpu_adam: Literal["auto", CpuAdam] = "auto"
    """AdamW of the states the CPU updates: 'native' builds (once per machine, with the system C compiler,
    cached under ~/.cache/angelgpt or $ANGELGPT_CACHE) a kernel that reads the model-dtype gradient,
    updates the fp32 states and writes the model-dtype weights in one pass over memory; 'torch' converts
    the gradient to fp32, runs torch's fused AdamW and converts the weights back; 'auto' is 'native'
    where it builds, else 'torch'."""
    max_contigous_params_size: int = -1
    """Bytes of GPU memory for fetched (offloaded) weights, the running layer's and those prefetched:
    prefetching stops short of it; -1 means no limit."""
    prefetch_bucket_size: int = 50_000_000
    """Parameters of the next offloaded layers fetched ahead of the one that runs (forward order, or
    reverse while backward recomputes); the next layer is always prefetched, further ones while their
    sum stays within this."""
    max_live_parameters: int = -1
    """Most fetched parameters on the GPU at once, the running layer's and those prefetched: prefetching
    stops short of it (the layer about to run is always fetched); -1 means no limit."""
    max_param_reduce_events: int = 1
    """Gradient reduce-scatters in flight at once (0 or 1 recommended)."""
    is_communication_time_profiling: bool = False
    """Print per-iteration time in all-gather, reduce-scatter, H2D, D2H, NVMe I/O and optimizer."""
    host_max_gib: Optional[Float] = None
    """Most GiB of host memory the store may take per rank; None means most of MemAvailable."""
    nvme_path: Optional[str] = None
    """Directory for the NVMe tier; None turns the tier off."""
    nvme_max_gib: Optional[Float] = None
    """Most GiB the NVMe tier may use; None means what the disk has free."""
    chunk_numel: int = 1 << 28
    """Most elements of one chunk of states: a sub-group's parameters of one weight-decay class are
    packed into chunks of whole parameters up to this size (a larger parameter is a chunk alone), so that
    the placement can split a layer between the GPU and the host (a layer of the 55B shape: three chunks
    of 2**28). The unit the planner places and the NVMe tier writes."""
    update_slice_numel: int = 1 << 26
    """Elements of a chunk updated at a time: the fp32 gradient scratch and the pinned upload buffers hold
    one slice (the device update buffers at most 2**25); a multiple of 256, an fp8 moment's scale block.
    Smaller slices take less memory and overlap finer; larger ones launch fewer kernels."""
    triton_codec: bool = True
    """Convert states kept in other dtypes than fp32 (bf16 remainders, bf16 and fp8 moments) on the GPU
    with Triton kernels, one pass each, where Triton imports; false uses torch's ops (the same bits,
    with temporaries)."""

    def __post_init__(self):
        _fraction("zero_cache.prefetch_cache_sub_group_rate", self.prefetch_cache_sub_group_rate)
        _fraction("zero_cache.device_update_fraction", self.device_update_fraction)
        _require(self.max_contigous_params_size == -1 or self.max_contigous_params_size > 0,
                 f"zero_cache.max_contigous_params_size must be -1 or > 0, got {self.max_contigous_params_size}")
        _positive("zero_cache", prefetch_bucket_size=self.prefetch_bucket_size)
        _require(self.max_live_parameters == -1 or self.max_live_parameters > 0,
                 f"zero_cache.max_live_parameters must be -1 or > 0, got {self.max_live_parameters}")
        _require(self.max_param_reduce_events >= 0,
                 f"zero_cache.max_param_reduce_events must be >= 0, got {self.max_param_reduce_events}")
        _require(self.host_max_gib is None or self.host_max_gib >= 0,
                 f"zero_cache.host_max_gib must be >= 0, got {self.host_max_gib}")
        _require(self.nvme_max_gib is None or self.nvme_max_gib > 0,
                 f"zero_cache.nvme_max_gib must be > 0, got {self.nvme_max_gib}")
        _positive("zero_cache", chunk_numel=self.chunk_numel)
        _require(self.update_slice_numel > 0 and self.update_slice_numel % 256 == 0,
                 f"zero_cache.update_slice_numel must be a positive multiple of 256, got {self.update_slice_numel}")


@_section
class DataConfig:
    paths: Union[str, List[Union[str, Float]]] = "mock"
    """'mock' (Megatron's mock dataset), one dataset prefix, or a blend [weight, prefix, weight, prefix, ...]."""
    split: str = "949,50,1"
    """Train, valid, test proportions of each dataset."""
    tokenizer: Optional[str] = None
    """Tokenizer directory (tokenizer.model from `angelgpt tokenizer train`); needed with real data."""
    cache_path: Optional[str] = None
    """Where Megatron's dataset index caches go; None means beside the data."""

    def __post_init__(self):
        if isinstance(self.paths, list):
            _require(len(self.paths) > 0, "data.paths must not be empty")
            if len(self.paths) > 1:
                _require(len(self.paths) % 2 == 0 and all(isinstance(w, (int, float)) for w in self.paths[0::2])
                         and all(isinstance(p, str) for p in self.paths[1::2]),
                         "data.paths as a blend must be [weight, prefix, weight, prefix, ...]")
        parts = self.split.split(",")
        ok = len(parts) == 3 and all(p.strip().replace(".", "", 1).isdigit() for p in parts)
        _require(ok and sum(float(p) for p in parts) > 0,
                 f"data.split must be three non-negative numbers like '949,50,1', got '{self.split}'")

    @property
    def is_mock(self) -> bool:
        return self.paths == "mock"

    def check_files(self) -> None:
        """Every dataset prefix has its .bin and .idx; a tokenizer is named for real data."""
        if self.is_mock:
            return
        items = [self.paths] if isinstance(self.paths, str) else self.paths
        prefixes = items[1::2] if len(items) > 1 else items
        for prefix in prefixes:
            for ext in (".bin", ".idx"):
                _require(os.path.isfile(f"{prefix}{ext}"),
                         f"data.paths: {prefix}{ext} not found (prefixes name files without .bin/.idx)")
        _require(self.tokenizer is not None, "data.tokenizer must be set when data.paths names real data")


@_section
class CheckpointConfig:
    save: Optional[str] = None
    """Directory to save checkpoints into; None saves nothing."""
    load: Optional[str] = None
    """Directory to resume from (its latest checkpoint); None starts fresh."""
    save_interval: Optional[int] = None
    """Save every N iterations (and always at the end when save is set)."""
    keep: Optional[int] = None
    """Keep only the newest N checkpoints under save; None keeps all."""
    multi_slice: bool = True
    """Write checkpoints tensor by tensor (GPU tensors pass through host memory one at a time, host
    and NVMe states are written from where they live) so a synchronous save never holds a second copy
    of the model in host memory; false first copies every tensor the rank writes into host memory, as
    Megatron's torch_dist saver does, then writes the copies (where host memory cannot hold them the
    save streams, saying so in one line). Applies to every optimizer. Also accepted as
    zero_cache.save_large_model_multi_slice, its earlier name."""
    async_save: bool = False
    """Write checkpoints in the background (Megatron's --async-save): at a save each rank copies the
    tensors it writes into host memory (training waits for that copy only), training goes on while a
    thread writes the copies into iter_N.tmp, and at a later iteration boundary, once every rank has
    written, the save is finalized (manifest, rename, tracker); one save in flight, a second waits for
    the first. The copy costs host memory until the write ends: what the rank writes, its shard of the
    optimizer states (fp32 master and two moments: 12 bytes per parameter / (TP x PP x DP) with ZeRO-Cache
    or Megatron's distributed optimizer) plus the bf16 weights it is the main replica of (at most 2 bytes
    per parameter / (TP x PP)). A rank whose available host memory (the node's, shared by its
    ranks, less 10%) cannot hold the copy writes synchronously, saying so in one line. The run's last
    save (end, exit_interval, signal, abort) is written synchronously. Off by default, as in Megatron:
    with ZeRO-Cache the copy doubles the host memory the states take. The host copy is one buffer,
    pinned on GPU machines, allocated at the first asynchronous save and kept for the next ones, so
    after the first save training waits only for the device-to-host copy."""
    dist_ckpt_optim_fully_reshardable: bool = False
    """Megatron's distributed optimizer (optim.optimizer megatron, megatron_cpu_offload) saves its states
    in Megatron's fully_reshardable format (Megatron's --dist-ckpt-optim-fully-reshardable): shaped and
    keyed like the params, so the checkpoint resumes at any TP, PP and DP. At a save every rank gathers
    its data-parallel group's states into host memory (12 bytes per parameter / (TP x PP)) and DP rank 0
    writes them; a load reads them whole per TP x PP part. The gather passes every state through host
    memory before the save returns, so an asynchronous save's stall grows by it. false (the default, as
    in Megatron): Megatron's dp_reshardable, each rank writing its own shard without communication or a
    gathered copy; that checkpoint resumes at another data-parallel size only (a resume at another TP
    or PP is refused in one line naming this option). A checkpoint records its format: a load follows
    it, whatever this says. Other optimizers' checkpoints reshard at any layout regardless."""
    stop_grace_s: Float = 900.0
    """Seconds a stop request (SIGTERM, SIGINT or SIGUSR1 to the launcher, its workers or both) gives
    the save it starts: the same request arriving again within this time (a scheduler signalling every
    process of the job, a second Ctrl-C) changes nothing; one arriving later, or SIGKILL, ends the job
    at once, and the checkpoint being written is not the one a resume loads."""
    def __post_init__(self):
        _require(self.save_interval is None or self.save_interval > 0,
                 f"checkpoint.save_interval must be > 0, got {self.save_interval}")
        _require(self.stop_grace_s > 0, f"checkpoint.stop_grace_s must be > 0, got {self.stop_grace_s}")
        _require(self.keep is None or self.keep > 0, f"checkpoint.keep must be > 0, got {self.keep}")


@_section
class LoggingConfig:
    log_interval: int = 1
    """Print a log line every N iterations."""
    tensorboard_dir: Optional[str] = None
    """Directory for TensorBoard event files; None writes none."""
    metrics_file: Optional[str] = None
    """JSON-lines file that receives one record per log line."""
    wandb_project: Optional[str] = None
    """Weights & Biases project that receives the same records as TensorBoard (and the resolved config
    as the run's config), from the rank that writes the log; None: no W&B. Needs `pip install
    angelgpt[wandb]`."""
    wandb_mode: Optional[Literal["online", "offline", "disabled"]] = None
    """'online', 'offline' (a run directory under wandb_dir, for `wandb sync` later) or 'disabled';
    None: wandb's own choice (WANDB_MODE when set, else online, which needs `wandb login`)."""
    wandb_dir: Optional[str] = None
    """Directory W&B writes its run directory (wandb/...) under; None: wandb's own (WANDB_DIR, else the
    working directory)."""
    profile_steps: Optional[Union[str, List[int]]] = None
    """Iterations START,END (1-based, inclusive; "START,END" or [START, END]) that torch.profiler
    traces on every rank, written under profile_dir as RANK files TensorBoard's profiler plugin opens
    (torch-tb-profiler); None: no profile."""
    profile_dir: Optional[str] = None
    """Directory for the profiler traces; None: TENSORBOARD_DIR/profile when tensorboard_dir is set (so
    `tensorboard --logdir TENSORBOARD_DIR` shows them), else ./profile."""
    memory_snapshot: Optional[str] = None
    """GPU only: record the CUDA caching allocator's history from the start of training and write a
    snapshot (a pickle for https://pytorch.org/memory_viz) to this path after the third iteration, or
    at the end of a shorter run; with several ranks each writes PATH with .rankR before the suffix. On
    CPU a one-line notice says it applies to GPUs."""

    def __post_init__(self):
        _positive("logging", log_interval=self.log_interval)
        if self.wandb_project is not None:
            _require(bool(str(self.wandb_project).strip()), "logging.wandb_project must not be empty")
            _require(_importable("wandb"), "logging.wandb_project is set but wandb is not installed: "
                                           "pip install 'angelgpt[wandb]' (or wandb)")
        if self.profile_steps is not None:
            self.profile_steps = _start_end("logging.profile_steps", self.profile_steps)


@_section
class TrainConfig:
    micro_batch_size: int = 2
    """Sequences per micro batch per data-parallel rank."""
    global_batch_size: int = 8
    """Sequences per optimizer step over all data-parallel ranks."""
    train_iters: int = 50
    """Optimizer steps to train."""
    exit_interval: Optional[int] = None
    """Stop (saving first when checkpoint.save is set) once the iteration is a multiple of this."""
    exit_duration_mins: Optional[Float] = None
    """Wall-clock limit of the job in minutes, counted from the launcher's start (Megatron's
    --exit-duration-in-mins): at the last iteration boundary that leaves time for what is due at it
    (an interval save, an evaluation), one more iteration, and the evaluation and save a stop ends with,
    half again for safety and at least 2 s (the last save's and evaluation's measured durations; before
    any save, 16 bytes per parameter of the rank at 1 GB/s), every rank saves (when checkpoint.save is
    set) and the job exits 0. None: no limit."""
    eval_interval: Optional[int] = None
    """Compute validation loss every N iterations; None never."""
    max_consecutive_skips: int = 10
    """Abort (saving the last good state first) after this many skipped iterations in a row."""
    eval_iters: int = 2
    """Global batches per validation."""
    seed: int = 1234
    """Seed for initialisation and data order."""
    device: Literal["auto", Device] = "auto"
    """'auto' (cuda when available), 'cpu' (fp32, gloo) or 'cuda' (bf16, NCCL)."""

    def __post_init__(self):
        _positive("train", micro_batch_size=self.micro_batch_size, global_batch_size=self.global_batch_size,
                  train_iters=self.train_iters, eval_iters=self.eval_iters)
        _require(self.exit_interval is None or self.exit_interval > 0,
                 f"train.exit_interval must be > 0, got {self.exit_interval}")
        _require(self.exit_duration_mins is None or self.exit_duration_mins > 0,
                 f"train.exit_duration_mins must be > 0, got {self.exit_duration_mins}")
        _positive("train", max_consecutive_skips=self.max_consecutive_skips)
        _require(self.eval_interval is None or self.eval_interval > 0,
                 f"train.eval_interval must be > 0, got {self.eval_interval}")
        _require(self.global_batch_size % self.micro_batch_size == 0,
                 f"train.micro_batch_size ({self.micro_batch_size}) must divide train.global_batch_size "
                 f"({self.global_batch_size})")


SECTIONS = {
    "model": ModelConfig,
    "parallel": ParallelConfig,
    "optim": OptimConfig,
    "zero_cache": ZeroCacheConfig,
    "data": DataConfig,
    "checkpoint": CheckpointConfig,
    "logging": LoggingConfig,
    "train": TrainConfig,
}


@_section
class Config:
    name: str = "custom"
    """Preset the configuration started from."""
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    zero_cache: ZeroCacheConfig = field(default_factory=ZeroCacheConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    def __post_init__(self):
        tp = self.parallel.tensor_model_parallel_size
        _require(self.model.num_attention_heads % tp == 0,
                 f"parallel.tensor_model_parallel_size ({tp}) must divide model.num_attention_heads "
                 f"({self.model.num_attention_heads})")
        _require(self.model.num_query_groups % tp == 0,
                 f"parallel.tensor_model_parallel_size ({tp}) must divide model.num_query_groups "
                 f"({self.model.num_query_groups})")
        _require(self.model.ffn_hidden_size % tp == 0,
                 f"parallel.tensor_model_parallel_size ({tp}) must divide model.ffn_hidden_size "
                 f"({self.model.ffn_hidden_size})")
        _require(not self.parallel.sequence_parallel or self.model.seq_length % tp == 0,
                 f"parallel.sequence_parallel splits the sequence over tensor_model_parallel_size ({tp}), which "
                 f"must divide model.seq_length ({self.model.seq_length})")
        pp = self.parallel.pipeline_model_parallel_size
        _require(self.model.num_layers % pp == 0,
                 f"parallel.pipeline_model_parallel_size ({pp}) must divide model.num_layers "
                 f"({self.model.num_layers})")
        k = self.model.recompute_num_layers
        _require(k is None or k <= self.model.num_layers // pp,
                 f"model.recompute_num_layers ({k}) counts layers per pipeline stage: at most "
                 f"{self.model.num_layers // pp} with {pp} stages")

    @property
    def model_parallel_size(self) -> int:
        return self.parallel.tensor_model_parallel_size * self.parallel.pipeline_model_parallel_size

    def data_parallel_size(self, world_size: int) -> int:
        """Checks the world size against TP x PP and the batch sizes; returns DP."""
        mp = self.model_parallel_size
        _require(world_size > 0 and world_size % mp == 0,
                 f"world size {world_size} is not divisible by tensor x pipeline parallel size "
                 f"({self.parallel.tensor_model_parallel_size} x {self.parallel.pipeline_model_parallel_size} = {mp})")
        dp = world_size // mp
        per_step = self.train.micro_batch_size * dp
        _require(self.train.global_batch_size % per_step == 0,
                 f"train.global_batch_size ({self.train.global_batch_size}) must be divisible by "
                 f"train.micro_batch_size x data-parallel size ({self.train.micro_batch_size} x {dp} = {per_step})")
        return dp

    def num_microbatches(self, dp: int) -> int:
        """Micro batches each data-parallel rank runs per optimizer step."""
        return self.train.global_batch_size // (self.train.micro_batch_size * dp)

    def check_device(self, on_gpu: bool) -> None:
        """Refuses what this build cannot run on the chosen device."""
        if on_gpu:
            _require(self.optim.spec.runs_on_gpu,
                     f"optim.optimizer '{self.optim.optimizer}' runs on the CPU only ({self.optim.spec.description})")
            _require(self.model.activation_offload != "checkpoints" or self.model.recompute == "full",
                     f"model.activation_offload 'checkpoints' moves the inputs that recompute keeps: it needs "
                     f"model.recompute 'full', got '{self.model.recompute}'")
        if not on_gpu:
            _require(self.optim.spec.runs_on_cpu,
                     f"optim.optimizer '{self.optim.optimizer}' needs CUDA ({self.optim.spec.description})")
            _require(self.model.recompute != "full",
                     "model.recompute 'full' needs CUDA (Megatron's activation checkpointing saves the CUDA RNG "
                     "state); use 'none' on CPU")

    def padded_vocab_size(self) -> int:
        multiple = self.model.make_vocab_size_divisible_by * self.parallel.tensor_model_parallel_size
        return -(-self.model.vocab_size // multiple) * multiple


# A resolved config: the sections whose settings may be 'auto', each such field narrowed to its values.
@_section
class ResolvedModelConfig(ModelConfig):
    recompute: Recompute
    activation_offload: ActivationOffload
    transformer_impl: TransformerImpl


@_section
class ResolvedOptimConfig(OptimConfig):
    store_param_remainders: bool


@_section
class ResolvedZeroCacheConfig(ZeroCacheConfig):
    prefetch_cache_sub_group_rate: Float
    offload_params: bool
    accumulate_in_store: bool
    device_update_fraction: Float
    cpu_adam: CpuAdam


@_section
class ResolvedTrainConfig(TrainConfig):
    device: Device


@dataclass(config=_CHECKED, kw_only=True)  # its sections have no defaults
class ResolvedConfig(Config):
    """A Config with every setting a value, none 'auto': what the planner's resolve_config returns, the
    run config the launcher writes and the workers build from. Construction refuses an 'auto' (pydantic's
    ValidationError naming the field)."""
    model: ResolvedModelConfig
    optim: ResolvedOptimConfig
    zero_cache: ResolvedZeroCacheConfig
    train: ResolvedTrainConfig

    @classmethod
    def from_config(cls, cfg: Config) -> ResolvedConfig:
        """cfg's values as a ResolvedConfig."""
        types = typing.get_type_hints(cls)
        return cls(name=cfg.name, **{name: types[name](**{f.name: getattr(getattr(cfg, name), f.name)
                                                          for f in fields(getattr(cfg, name))})
                                     for name in SECTIONS})
