"""`Optimizer`: what the training loop, checkpoints and the worker ask of an optimizer (in the spirit
of Megatron's `MegatronOptimizer` and torchtitan's `OptimizersContainer`), with defaults where an
optimizer has nothing to say.

    ok, grad_norm, _ = optimizer.step()        # False: a non-finite norm, the step skipped
    optimizer.zero_grad()                      # before the next forward-backward
    with optimizer.materialized():             # weights readable in place (checkpoint save and load)
        sd = optimizer.sharded_state_dict(model.sharded_state_dict(), is_loading=False)
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from typing import Dict, List, Optional, Tuple

from angelgpt.zero_cache.rules import clip_coefficient, no_weight_decay  # noqa: F401 (the math they share)


class Optimizer(ABC):
    """One interface for every optimizer angelgpt trains with."""

    #: checkpoint keys carry the layer number (a layer's tensors saved one by one rather than stacked
    #: along Megatron's layer axis); optimizers whose state is per parameter of a layer say True
    per_layer_checkpoint_keys: bool = False

    @property
    @abstractmethod
    def param_groups(self) -> List[dict]:
        """The parameter groups the LR scheduler sets 'lr' and 'weight_decay' in."""

    @abstractmethod
    def step(self) -> Tuple[bool, float, Optional[int]]:
        """One update from the accumulated gradients: (applied, global gradient norm, zeros counted or None).
        A non-finite norm leaves the weights alone and returns False."""

    @abstractmethod
    def zero_grad(self) -> None:
        """Forget the gradients before the next step's micro batches."""

    @abstractmethod
    def sharded_state_dict(self, model_sharded_state_dict: dict, is_loading: bool = False,
                           metadata: Optional[dict] = None) -> dict:
        """The optimizer state as Megatron dist_checkpointing sharded tensors, keyed against the model's.
        `metadata`: the checkpoint's format choices as Megatron names them (its
        `distrib_optim_sharding_type`), the ones the checkpoint was saved with when loading."""

    @abstractmethod
    def load_state_dict(self, state: dict) -> None:
        """Takes what dist_checkpointing loaded for sharded_state_dict(..., is_loading=True)."""

    def reload_model_params(self) -> None:
        """After the model's weights were loaded without optimizer state: the optimizer's own copies of
        them (main parameters) taken from the model; nothing to do where it updates the model's."""

    def checkpoint_safe_globals(self) -> list:
        """Classes this optimizer's saved common state holds, which torch's weights-only load (the
        default of torch.load, which Megatron's dist_checkpointing calls) is allowed to rebuild."""
        return []

    def checkpoint_metadata(self) -> dict:
        """What a checkpoint records about this optimizer's state beside Megatron's format choices (its
        content metadata; given back to sharded_state_dict as `metadata` when loading)."""
        return {}

    def materialized(self):
        """A context in which every weight is an ordinary readable tensor (offloading optimizers bring
        theirs back for a checkpoint); nothing to do by default."""
        return contextlib.nullcontext()

    def wait(self) -> None:
        """Every update started is applied (before an evaluation, a checkpoint or the end)."""

    def close(self) -> None:
        """Release threads, pinned memory and files; the optimizer is not used after."""

    def summary(self) -> Optional[str]:
        """One line printed once after building: where the states went, what updates them."""
        return None

    def profile_record(self) -> Optional[dict]:
        """The last iteration's transfer and update times, when profiling is on (for the metrics file)."""
        return None

    def profile_line(self) -> Optional[str]:
        """profile_record() as one printable line."""
        return None

    def memory(self) -> Dict[str, int]:
        """Bytes the optimizer itself holds, per tier ('device', 'host', 'nvme')."""
        return {}
