"""The logged loss is the mean token loss of a micro batch, whatever Megatron's schedule does to the loss it
back-propagates."""
from functools import partial
from types import SimpleNamespace

import torch
from megatron.core.pipeline_parallel.schedules import forward_step_calc_loss

from angelgpt.train.step import loss_func


def test_logged_loss_is_not_scaled_by_the_number_of_micro_batches():
    torch.manual_seed(0)
    per_token = torch.rand(2, 16, requires_grad=True)  # [b, s]
    mask = torch.ones(2, 16)
    mask[1, 8:] = 0
    expected = (per_token * mask).sum().item() / mask.sum().item()
    store = []
    config = SimpleNamespace(timers=None, calculate_per_token_loss=False)
    forward_step_calc_loss(None, per_token, partial(loss_func, mask), config, None, False, 8, store,
                           cp_group_size=1, is_last_stage=True)
    assert abs(store[0]["lm loss"].item() - expected) < 1e-6
