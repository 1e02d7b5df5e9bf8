"""The state codec's Triton kernels compiled on CUDA write what torch's ops write on the CPU, bit for
bit (tests/unit/test_zero_cache_triton_codec.py's comparison), and precision.encode and decode, which
the device update calls, take them for CUDA tensors and agree with the CPU's."""

import pytest
import torch

from tests.unit.test_zero_cache_triton_codec import compare_codec, master_bits, moment_values

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_the_triton_codec_writes_what_torchs_ops_write_on_gpu():
    from angelgpt.zero_cache import triton_codec

    compare_codec(triton_codec, "cuda")


def test_encode_and_decode_on_cuda_agree_with_the_cpu():
    from angelgpt.zero_cache import precision
    from angelgpt.zero_cache.precision import StateFormat, decode, encode

    assert precision._kernels_for(torch.empty(1, device="cuda")) is not None  # the kernels are in use
    gen = torch.Generator().manual_seed(11)
    fmt = StateFormat(True, "fp8", "fp8")
    n = (1 << 22) + 3000
    work = torch.stack([master_bits(n, gen), moment_values(n, gen), moment_values(n, gen).square()])
    out = {}
    for device in ("cpu", "cuda"):
        raw = torch.zeros(fmt.nbytes(n), dtype=torch.uint8, device=device)
        rows, hi = fmt.rows(raw, n), torch.empty(n, dtype=torch.bfloat16, device=device)
        encode(fmt, work.to(device), rows, hi, seed=(3, 4), base=256)
        back = torch.empty(3, n, device=device)
        decode(fmt, rows, hi, back)
        out[device] = (raw.cpu(), hi.cpu().view(torch.int16), back.cpu().view(torch.int32))
    for a, b in zip(out["cpu"], out["cuda"]):
        assert torch.equal(a, b)
