"""The memory model shared by every system: a stage's activations (Megatron's formula, recompute and
activation offload), micro batches in flight under 1F1B, gradient bytes, and beside_store_bytes.

GPU activations follow Korthikanti et al., 2022: s*b*h*34 per layer without recompute with flash
attention, s*b*h*2 per recomputed layer plus one layer's full set while it recomputes; logits in fp32;
what a micro batch keeps until its backward, once per micro batch the stage holds in flight under 1F1B
(micro_batches_in_flight). With model.activation_offload 'checkpoints' the recomputed layers' kept
inputs leave the GPU for pinned host memory (offloaded_activation_bytes).
"""

from __future__ import annotations

from typing import Dict, Optional

from angelgpt.config import Config, ResolvedConfig
from angelgpt.model.flops import recomputed_layers
from angelgpt.planner.calibration import MODEL_BYTES, WORKSPACE


def micro_batches_in_flight(cfg: Config, dp: int, pp_rank: int = 0) -> int:
    """Micro batches whose forward has run and backward not yet, at most, on pipeline stage pp_rank:
    Megatron's 1F1B schedule (non-interleaved) runs PP - pp_rank - 1 warm-up forwards, then one more
    forward before each backward, so stage p holds up to PP - p of them (fewer when the step has fewer
    micro batches); 1 without pipeline parallelism."""
    pp = cfg.parallel.pipeline_model_parallel_size
    return max(1, min(pp - pp_rank, cfg.num_microbatches(dp)))


def activation_bytes(cfg: Config, recompute: Optional[bool] = None, offload: Optional[bool] = None,
                     in_flight: int = 1) -> int:
    """Peak GPU activation memory of one pipeline stage with `in_flight` micro batches between forward and
    backward (micro_batches_in_flight; bf16): as configured, or with every layer recomputed (True) or none
    (False); the recomputed layers' kept inputs off the GPU with activation offload as configured ('auto'
    counts as off), or on (True) or off (False). What a micro batch stores until its backward counts once
    per micro batch in flight; the logits and a recomputed layer's full set, made during one micro
    batch's backward, once."""
    m, tp = cfg.model, cfg.parallel.tensor_model_parallel_size
    s, b, h = m.seq_length, cfg.train.micro_batch_size, m.hidden_size
    layers = m.num_layers // cfg.parallel.pipeline_model_parallel_size
    # 10*sbh (norm and block inputs, dropout masks), unsharded unless sequence parallelism splits it over
    # TP too, attention's Q, K, V and output 8*sbh/tp (flash attention: no s*s), the MLP's two ffn-wide
    # tensors: 34*sbh at tp 1 with ffn 4h (measured on the H200 without recompute: 33.5*sbh a layer, 7
    # layers of the 55 shape from micro batch 1 to 2: peers-zero_cache-L7-mb1-gb32-recomputenone.json,
    # peers-zero_cache-L7-mb2-gb32-recomputenone.json); 10*sbh + 24*sbh/tp, or 34*sbh/tp with sequence
    # parallelism (Korthikanti et al. 2022). With grouped-query attention K and V are num_query_groups
    # heads wide (Q, K, V and output: 2*(2q + 2kv) bytes a token); SwiGLU keeps five ffn-wide tensors
    # where GELU keeps two: linear_fc1's 2*ffn output, megatron-core's up half plus glu_linear_offset (a
    # new tensor), silu(gate) and the product linear_fc2 takes (tests/unit/test_llama_arch.py measures it)
    sp = tp if cfg.parallel.sequence_parallel else 1
    q, kv = m.num_attention_heads * m.kv_channels, m.num_query_groups * m.kv_channels
    ffn_tensors = 5 if m.swiglu else 2
    full_layer = s * b * (10 * h * tp // sp + 4 * q + 4 * kv) // tp + s * b * m.ffn_hidden_size * 2 * ffn_tensors // tp
    recomputed = recomputed_layers(cfg) // cfg.parallel.pipeline_model_parallel_size if recompute is None \
        else (layers if recompute else 0)
    # the first `recomputed` layers keep their inputs; the rest keep everything, and are done with in
    # backward before the first recomputed layer's full set comes back
    on_gpu_inputs = 0 if _offloading(cfg, offload) else recomputed * _layer_input_bytes(cfg)
    # the logits at their peak: the output layer's bf16 logits beside the fp32 copy Megatron's
    # vocab-parallel cross entropy makes and keeps for backward (its exp, softmax and gradient are made in
    # place in that copy), then that fp32 gradient beside its bf16 cast for the output layer's backward:
    # 2 + 4 bytes an element (read from megatron-core's cross entropy, not fitted)
    logits = s * b * cfg.padded_vocab_size() // tp * (MODEL_BYTES + 4)
    # the logits peak at the end of forward, beside every layer's stored activations; they are gone
    # before the last recomputed layer's full set is made again in backward
    return in_flight * on_gpu_inputs + (in_flight - 1) * (layers - recomputed) * full_layer + max(
        (layers - recomputed) * full_layer + logits, full_layer if recomputed else 0)


def _offloading(cfg: Config, offload: Optional[bool] = None) -> bool:
    return cfg.model.activation_offload == "checkpoints" if offload is None else offload


def _layer_input_bytes(cfg: Config) -> int:
    """The input a recomputed layer keeps for its backward (what Megatron's checkpointing saves): s*b*h in
    bf16, split over TP with sequence parallelism."""
    m, tp = cfg.model, cfg.parallel.tensor_model_parallel_size
    sp = tp if cfg.parallel.sequence_parallel else 1
    return 2 * m.seq_length * cfg.train.micro_batch_size * m.hidden_size // sp


def offloaded_activation_bytes(cfg: Config, in_flight: int = 1) -> int:
    """Bytes that activation offload ('checkpoints') moves from one stage's GPU to pinned host memory for
    one micro batch: every recomputed layer's kept input (0 without offload or without recompute); what
    the host holds with `in_flight` micro batches between forward and backward is that many times it."""
    if not _offloading(cfg):
        return 0
    return in_flight * (recomputed_layers(cfg) // cfg.parallel.pipeline_model_parallel_size) * _layer_input_bytes(cfg)


def accumulating(cfg: Config, dp: int) -> bool:
    """Several micro batches per step, added up on the GPU: every gradient lives there until the last
    one (unless zero_cache.accumulate_in_store moves each micro batch's gradients to their owner)."""
    return cfg.num_microbatches(dp) > 1 and not (cfg.optim.spec.uses_zero_cache_settings
                                                and cfg.zero_cache.accumulate_in_store is True)


def grad_bytes(cfg: Config, dp: int, model_bytes: int = MODEL_BYTES) -> int:
    """Bytes per element of the gradients that micro batches add up in (ZeRO-Cache's main grads, slots and
    gradient buffers): 4 with optim.accumulate_grads_in_fp32 and several micro batches per step, else the
    model's (with one micro batch nothing adds up)."""
    return 4 if cfg.optim.accumulate_grads_in_fp32 and cfg.num_microbatches(dp) > 1 else model_bytes


def beside_store_bytes(cfg: ResolvedConfig, dp: int = 1, pp_rank: int = 0) -> int:
    """Device memory training needs beside ZeRO-Cache's store that the optimizer cannot count itself, on
    a rank of pipeline stage pp_rank with data-parallel size dp: the activations of the stage's micro
    batches in flight (micro_batches_in_flight; as configured: recompute resolved) and the workspace.
    The optimizer adds the gradients and fetched weights (placement.training_reserve) and leaves
    GPU_HEADROOM free."""
    return activation_bytes(cfg, in_flight=micro_batches_in_flight(cfg, dp, pp_rank)) + WORKSPACE


def sub_group_numels(params) -> Dict[int, int]:
    """Elements of each sub-group (0 embedding, 1 + layer, num_layers + 1 the output) of these params."""
    sizes: Dict[int, int] = {}
    for p in params:
        sizes[p.sub_group] = sizes.get(p.sub_group, 0) + p.numel
    return sizes
