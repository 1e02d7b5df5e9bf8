"""Adam's step after Megatron's distributed optimizer loads a checkpoint without transformer-engine:
megatron-core 0.16 gives every param's state one shared `step` tensor holding a step that is not the
checkpoint's, while its loaded param groups carry the checkpoint's. angelgpt.optimizer.megatron's
`_checkpoint_steps` gives each state its own, as torch's AdamW keeps it (the load is Megatron's, on a
GPU; here torch's AdamW is given the state that load leaves)."""

import pytest
import torch

from angelgpt.optimizer.megatron import _checkpoint_steps


def _as_megatron_loads(opt, checkpoint_step: float, left_step: float) -> None:
    """The state and param groups Megatron's load leaves in a torch AdamW: one step tensor shared by
    every param (holding `left_step`), the param groups carrying the checkpoint's step."""
    shared = torch.tensor(left_step)
    state = opt.state_dict()
    for s in state["state"].values():
        s["step"] = shared
    for group in state["param_groups"]:
        group["step"] = checkpoint_step
    opt.load_state_dict(state)


@pytest.mark.parametrize("fused", [False, True])
def test_each_param_goes_on_from_the_checkpoints_adam_step(fused):
    params = [torch.nn.Parameter(torch.randn(8)) for _ in range(3)]
    opt = torch.optim.AdamW(params, lr=1e-3, fused=fused)
    for p in params:
        p.grad = torch.randn(8)
    opt.step()
    _as_megatron_loads(opt, checkpoint_step=6.0, left_step=1.0)
    steps = [opt.state[p]["step"] for p in params]
    assert len({id(s) for s in steps}) == 1  # as Megatron's load leaves it: one tensor, advanced once a param
    _checkpoint_steps(opt)
    opt.step()
    steps = [opt.state[p]["step"] for p in params]
    assert len({id(s) for s in steps}) == len(params)
    assert [float(s) for s in steps] == [7.0] * len(params)
    assert all(s.dtype == torch.float32 and s.device.type == "cpu" for s in steps)
