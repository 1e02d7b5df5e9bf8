"""Deferred layer init (angelgpt.model.deferred): transformer layers built on the meta device and made real
one sub-group at a time by ZeRO-Cache's store, so that a rank's whole model never sits on its device.
On CPU the materialized layers are the ordinary build's, bit for bit."""

import pytest
import torch

from angelgpt.config import parse
from angelgpt.planner import MACHINES, resolve_config
from tests.helpers import one_quick


def _zero_cache_cfg(*overrides, size="tiny"):
    cfg = parse(size, overrides=["optim.optimizer=zero_cache", "model.num_layers=4", "train.micro_batch_size=2",
                                     "train.global_batch_size=2", *overrides])
    cfg, _ = resolve_config(cfg, MACHINES["h200"], 1, 1, False)
    return cfg


@pytest.mark.parametrize("size", one_quick("tiny", ["tiny", "llama-tiny"]))
@pytest.mark.parametrize("offload", one_quick(True, [False, True]))
def test_a_deferred_build_holds_no_layer_until_the_store_fills_and_then_equals_the_ordinary_build(
        megatron_single_rank, offload, size):
    from angelgpt.model.deferred import materializer
    from angelgpt.model.gpt import build_gpt
    from angelgpt.optimizer.zero_cache import ZeroCacheOptimizer

    cfg = _zero_cache_cfg(f"zero_cache.prefetch_cache_sub_group_rate={0.0 if offload else 1.0}",
                          f"zero_cache.offload_params={str(offload).lower()}", "model.recompute=full", size=size)
    torch.manual_seed(cfg.train.seed)
    ref = build_gpt(cfg, on_gpu=False)
    torch.manual_seed(cfg.train.seed)
    model = build_gpt(cfg, on_gpu=False, defer_layers=True)
    layer_params = [n for n, _ in model.named_parameters() if ".layers." in n]
    assert layer_params and all(p.is_meta for n, p in model.named_parameters() if ".layers." in n)
    assert not any(p.is_meta for n, p in model.named_parameters() if ".layers." not in n)

    seen = []
    materialize = materializer(model, torch.device("cpu"))

    def spy(params):
        before = sum(p.is_meta for p in params)
        materialize(params)
        seen.append((before, sum(p.is_meta for p in params)))

    opt = ZeroCacheOptimizer(model, cfg, torch.device("cpu"), 0, materialize=spy)
    assert len(seen) == len(opt.layout.sub_groups) and all(after == 0 for _, after in seen)
    assert sum(before > 0 for before, _ in seen) == cfg.model.num_layers  # one call per layer, each made real
    assert list(opt.layout.partitioned[1:-1]) == [offload] * cfg.model.num_layers
    with opt.materialized():
        for (n, p), q in zip(model.named_parameters(), ref.parameters()):
            assert not p.is_meta and torch.equal(p.detach().cpu(), q.detach()), n
    opt.close()



def test_materialized_layers_take_the_dtype_the_model_was_cast_to(megatron_single_rank):
    """Megatron's Float16Module casts the built model (norms included) to bf16: a layer materialized
    afterwards must come out in bf16 too, not in the dtype its norms are built with."""
    from angelgpt.model.deferred import materializer
    from angelgpt.model.gpt import build_gpt

    cfg = _zero_cache_cfg()
    model = build_gpt(cfg, on_gpu=False, defer_layers=True).bfloat16()
    params = [p for n, p in model.named_parameters() if ".layers." in n]
    materializer(model, torch.device("cpu"))(params)
    assert params and all(not p.is_meta and p.dtype == torch.bfloat16 for p in params)


def test_the_capacity_check_counts_resident_layers_not_built_yet(megatron_single_rank, monkeypatch):
    """ZeRO-Cache reads the device's free memory before a deferred model's layers exist: the resident
    layers' weights must still be counted, and offloaded layers that never came are not given back. The
    device room the capacity check sees is the same as with the whole model built first."""
    from angelgpt.model.deferred import materializer
    from angelgpt.model.gpt import build_gpt
    from angelgpt.zero_cache import layout as layout_module
    from angelgpt.optimizer.zero_cache import ZeroCacheOptimizer

    cfg = _zero_cache_cfg("zero_cache.prefetch_cache_sub_group_rate=0.5", "zero_cache.offload_params=true",
                          "model.recompute=full")
    room = {}
    for defer in (False, True):
        model = build_gpt(cfg, on_gpu=False, defer_layers=defer)
        built = sum(p.numel() * p.element_size() for p in model.parameters() if not p.is_meta)
        monkeypatch.setattr(layout_module, "available_bytes",  # the device holds what is built
                            lambda *a, built=built, **k: {"device": 2 ** 40 - built, "host": 2 ** 40, "nvme": 0})
        monkeypatch.setattr(layout_module, "check_capacity",
                            lambda needed, avail, defer=defer: room.setdefault(defer, avail["device"]))
        opt = ZeroCacheOptimizer(model, cfg, torch.device("cpu"), 0,
                                 materialize=materializer(model, torch.device("cpu")) if defer else None)
        assert any(opt.layout.partitioned) and not all(opt.layout.partitioned[1:-1])
        opt.close()
    assert room[True] == room[False]
