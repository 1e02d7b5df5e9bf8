"""An optimizer added from one file, as a user's module does: SGD with momentum on CPU keeping angelgpt's
optimizer contract (angelgpt.optimizer.base.Optimizer), registered as 'toy_sgd'.

    angelgpt train --size tiny --device cpu optim.custom_import=[tests.toy_optimizer] optim.optimizer=toy_sgd
"""

import math

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from angelgpt.config import optimizers
from angelgpt.optimizer import Optimizer

MOMENTUM = 0.9


class ToySGD(Optimizer):
    """torch's SGD with momentum over the gradients averaged over data-parallel ranks (TP 1, PP 1)."""

    def __init__(self, model: torch.nn.Module, lr: float):
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.SGD(self.params, lr=lr, momentum=MOMENTUM)

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self):
        group = parallel_state.get_data_parallel_group()
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            if group.size() > 1:
                dist.all_reduce(p.grad, group=group)
                p.grad /= group.size()
        norm = math.sqrt(sum(float(p.grad.pow(2).sum()) for p in self.params))
        if not math.isfinite(norm):
            self.zero_grad()
            return False, norm, None
        self.optimizer.step()
        return True, norm, None

    def sharded_state_dict(self, model_sharded_state_dict, is_loading=False, metadata=None):
        from megatron.core.dist_checkpointing.optimizer import (
            get_param_id_to_sharded_param_map,
            optim_state_to_sharding_state,
        )

        if is_loading:  # the request needs every momentum buffer to load into
            for p in self.params:
                self.optimizer.state[p].setdefault("momentum_buffer", torch.zeros_like(p))
        state = self.optimizer.state_dict()
        state["state"] = {k: dict(v) for k, v in state["state"].items()}  # state_dict() shares the live dicts
        id_map = get_param_id_to_sharded_param_map(model_sharded_state_dict, iter(self.params))
        optim_state_to_sharding_state(state, id_map)
        return state

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state)


def build(model, cfg, on_gpu, *, deferred=False, beside_store_bytes=0, rehearsal=False):
    return model, ToySGD(model, cfg.optim.lr)


optimizers.register(optimizers.OptimizerSpec(name="toy_sgd", build=build, description="a test's SGD with momentum",
                                             runs_on_gpu=False))
