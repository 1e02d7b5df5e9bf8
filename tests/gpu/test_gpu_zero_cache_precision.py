"""ZeRO-Cache's compact state formats on a GPU (tests/unit/test_zero_cache_precision.py's comparison with
CUDA tensors, pinned host chunks and the CUDA streams): after one step from the same model and batches
the master kept as a remainder beside the bf16 weight equals the fp32 path's bit for bit in every tier,
bf16 moments are the fp32 path's rounded, fp8 ones within a code of it, and three more steps give
losses within 1e-3 (fp8: 1e-2). Attention runs
in torch's math kernel; a parameter whose gradients the GPU's atomics summed in another order in the
two runs (an embedding's rows) is left out of the bit-for-bit comparison, at most a fifth of them."""

import pytest
import torch

from tests.unit.test_zero_cache_precision import FORMATS, FP8, LAYOUTS, compare_formats, fp8_against_fp32

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_compact_states_update_as_the_fp32_path_does_on_gpu(megatron_single_rank, tmp_path, fmt, layout):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):
        compare_formats(tmp_path, fmt, "native", layout, "cuda", min_same=0.8)


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("fmt", list(FP8))
def test_fp8_moments_update_as_the_fp32_path_within_a_code_on_gpu(megatron_single_rank, tmp_path, fmt, layout):
    """fp8 moments on CUDA (device chunks and the device update through torch's codec, host chunks
    through the CPU kernel): the master the fp32 path's bit for bit where both runs' gradients agree,
    each moment one of the two codes around the fp32 path's, losses within 1e-2 over three more steps."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):
        fp8_against_fp32(tmp_path, fmt, "native", layout, "cuda", min_same=0.8)
