"""angelgpt.parallel.cpu_schedules: CUDA allocations, moves and synchronizes of code run inside on_cpu()
land on the CPU, on this thread only, and everything is restored on exit."""

import threading

import pytest
import torch

from angelgpt.parallel.cpu_schedules import check_config, on_cpu


def test_cuda_devices_become_the_cpu_inside_only():
    current, synchronize = torch.cuda.current_device, torch.cuda.synchronize
    x = torch.ones(3)
    with on_cpu():
        assert torch.cuda.current_device() == torch.device("cpu")
        torch.cuda.synchronize()
        made = [torch.zeros([], dtype=torch.int, device="cuda"),
                torch.empty((2, 1, 4), device=torch.cuda.current_device(), requires_grad=True),
                torch.tensor([1, 2], device=torch.device("cuda", 0)),
                torch.full((2,), 1.0, device="cuda:0"),
                x.cuda(), x.to("cuda"), x.to(device="cuda"), x.to(torch.float64)]
        assert all(t.device.type == "cpu" for t in made)
        assert made[1].requires_grad and made[-1].dtype == torch.float64
        assert made[4] is x
        seen = {}
        other = threading.Thread(target=lambda: seen.update(mode=torch.overrides._get_current_function_mode()))
        other.start()
        other.join()
        assert seen["mode"] is None  # the mode is this thread's
    assert torch.cuda.current_device is current and torch.cuda.synchronize is synchronize
    if not torch.cuda.is_available():
        with pytest.raises((RuntimeError, AssertionError)):
            torch.zeros(1, device="cuda")


def test_check_config_names_what_the_cpu_schedule_cannot_take():
    from megatron.core.transformer.transformer_config import TransformerConfig

    base = dict(num_layers=2, hidden_size=8, num_attention_heads=2, pipeline_dtype=torch.float32)
    check_config(TransformerConfig(**base, batch_p2p_comm=False))
    with pytest.raises(ValueError, match="batch_p2p_comm"):
        check_config(TransformerConfig(**base, batch_p2p_comm=True))
