"""ZeRO-Cache on a GPU adds eight micro batches of a bf16 model up in fp32 (optim.accumulate_grads_in_fp32,
the default), in the store and in main grads on the device; the bf16 opt-out does not. Skipped without CUDA."""

import socket

import pytest
import torch

from tests.unit.test_zero_cache_accumulation import _rel, accumulate

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
MICRO = 8


@pytest.fixture(scope="module")
def one_gpu_rank():
    """A one-rank NCCL group and Megatron's parallel state on this GPU."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    yield torch.device("cuda", 0)
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


@pytest.mark.parametrize("in_store", [True, False], ids=["in-store", "on-device"])
def test_eight_micro_batches_add_up_in_fp32_on_gpu(one_gpu_rank, in_store):
    """The flushed owned gradients (device chunks, pinned host chunks, offloaded layers) and the global
    norm equal the fp32 sum of the gradients the eight backward passes produced within 1e-6; the bf16
    opt-out's are further off than that from the fp32 sum of the same micro batches."""
    fp32 = accumulate(one_gpu_rank, in_store, fp32=True, micro=MICRO)
    fp32["opt"].close()
    assert fp32["chunk_grads"] == {torch.float32}
    assert (fp32["slots"] == {torch.float32}) if in_store else (fp32["main"] == {torch.float32})
    err = _rel(fp32["zc"], fp32["seen"])
    assert err <= 1e-6, err
    expected = torch.sqrt(sum((g.double() ** 2).sum() for g in fp32["seen"].values())).item()
    assert fp32["norm"] == pytest.approx(expected, rel=1e-6)

    bf16 = accumulate(one_gpu_rank, in_store, fp32=False, micro=MICRO)
    bf16["opt"].close()
    assert bf16["chunk_grads"] == {torch.bfloat16}
    off = _rel(bf16["zc"], bf16["ref32"])
    print(f"relative error against the fp32 sum: fp32 accumulation {err:.3g}, bf16 {off:.3g}")
    assert off > max(1e-5, 10 * err), (off, err)
