"""pytest fixtures; what the tests share otherwise is in tests/helpers.py."""

import pytest

from tests.helpers import CORPUS


@pytest.fixture
def corpus():
    if not CORPUS.is_file():
        pytest.skip(f"{CORPUS} not present")
    return CORPUS


@pytest.fixture(scope="module")
def megatron_single_rank():
    """A one-rank gloo group and Megatron's parallel state, for tests that build Megatron modules in process."""
    import socket

    import torch.distributed as dist
    from megatron.core import parallel_state

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    yield
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
