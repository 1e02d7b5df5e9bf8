"""ZeRO-Cache adds micro batches' gradients up in fp32 (optim.accumulate_grads_in_fp32, the default) for a
bf16 model, whichever path accumulate_in_store takes: fp32 main grads on the device, or fp32 gradient
buffers and slots in the store; the opt-out adds them up in bf16. Tested on one CPU rank with the tiny
model in bf16 (tests/gpu/test_gpu_zero_cache_accumulation.py runs the same on a GPU)."""

import shutil

import pytest
import torch

from angelgpt.optimizer import no_weight_decay
from tests.helpers import one_quick

MICRO = 4


def _rel(a: dict, b: dict) -> float:
    """||a - b|| / ||b|| over every parameter."""
    diff = sum(((a[k] - b[k]) ** 2).sum() for k in b).sqrt()
    return (diff / sum((v ** 2).sum() for v in b.values()).sqrt()).item()


def accumulate(device, in_store: bool, fp32: bool, micro: int = MICRO, step: bool = False, extra=()):
    """The tiny model in bf16 on `device`, `micro` micro batches through ZeRO-Cache (half the states on the
    device, the rest on the host, half of those updated by the device, offloaded layers' weights):
    what its accumulation buffers are, its flushed owned gradients, and references of the same micro
    batches: their gradients from a pass without the optimizer summed in fp32 and, in sequence, in bf16,
    and those seen in the optimizer's own backward passes summed in fp32 (a hook before its hooks)."""
    from angelgpt.config import parse
    from angelgpt.model.gpt import build_gpt
    from angelgpt.planner import MACHINES, resolve_config
    from angelgpt.optimizer.zero_cache import ZeroCacheOptimizer

    cfg = parse("tiny", overrides=[
        "optim.optimizer=zero_cache", "train.micro_batch_size=2", f"train.global_batch_size={2 * micro}",
        f"optim.accumulate_grads_in_fp32={str(fp32).lower()}", f"zero_cache.accumulate_in_store={str(in_store).lower()}",
        "zero_cache.prefetch_cache_sub_group_rate=0.5", "zero_cache.offload_params=true",
        "zero_cache.device_update_fraction=0.5", "model.recompute=none", *extra])
    cfg, _ = resolve_config(cfg, MACHINES["h200"], 1, 1, on_gpu=device.type == "cuda")
    torch.manual_seed(0)
    model = build_gpt(cfg, on_gpu=False).to(device=device, dtype=torch.bfloat16)
    named = dict(model.named_parameters())
    gen = torch.Generator().manual_seed(7)
    batches = [torch.randint(0, cfg.model.vocab_size, (2, cfg.model.seq_length), generator=gen).to(device)
               for _ in range(micro)]
    pos = torch.arange(cfg.model.seq_length, device=device).expand(2, -1)

    def backward(tokens):
        (model(tokens, pos, None, labels=tokens).float().mean() / micro).backward()

    ref32, ref16 = {}, {}
    for tokens in batches:  # the reference: each micro batch's gradient alone
        backward(tokens)
        for k, p in named.items():
            ref32[k] = ref32[k] + p.grad.float() if k in ref32 else p.grad.float()
            ref16[k] = ref16[k] + p.grad if k in ref16 else p.grad.clone()
            p.grad = None
    initial = {k: p.detach().float().clone() for k, p in named.items()}
    seen, current = {}, [0]

    def capture(name):
        def hook(p):  # runs before the optimizer's hook: this micro batch's gradient where it is released
            g = p.grad.float()    # after each micro batch (fp32 main grads, in-store)
            seen[name] = seen[name] + g if name in seen else g.clone()
        return hook

    handles = [p.register_post_accumulate_grad_hook(capture(k)) for k, p in named.items()]
    opt = ZeroCacheOptimizer(model, cfg, device, 0)
    layout, buffers = opt.layout, opt.buffers
    out = {"grad_dtype": layout.grad_dtype, "chunk_grads": {b.grad.dtype for b in buffers.chunks},
           "slots": {s.dtype for s in buffers.acc_slots}, "main_grads": layout.main_grads}
    for i, tokens in enumerate(batches):
        current[0] = i
        backward(tokens)
        if i == 1:  # mid-step: what holds the running sums
            out["main"] = {g.dtype for g in opt.gradients._main.values()}
            out["p_grad"] = {p.grad.dtype for p in named.values() if p.grad is not None}
    for h in handles:
        h.remove()
    opt.gradients.flush()
    out["norm"] = opt.gradients.global_norm()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    name_of = {id(p): k for k, p in named.items()}
    out["zc"] = {name_of[id(p)]: view.float().cpu() for c in layout.chunks
                 for p, view in c.views(buffers.chunks[c.index].grad)}
    out.update(ref32={k: v.cpu() for k, v in ref32.items()}, ref16={k: v.float().cpu() for k, v in ref16.items()},
               seen={k: v.cpu() for k, v in seen.items()}, cfg=cfg, opt=opt, model=model, initial=initial)
    if step:
        out["step"] = opt.step()
        opt.wait()
    return out


@pytest.mark.parametrize("in_store", one_quick(False, [True, False]), ids=["in-store", "on-device"])
def test_micro_batches_add_up_in_fp32(megatron_single_rank, in_store):
    """Four micro batches of a bf16 model: the running sums are fp32 (main grads on the device, or the
    store's buffers and slots), the flushed gradients equal the fp32 sum of the micro batches' gradients
    where the bf16 sum does not, the global norm is that sum's, and the update from it equals torch's
    AdamW on fp32 copies of the weights; offloaded layers' weights, now kept apart from their fp32
    gradient buffers, are the new master weights in bf16."""
    r = accumulate(torch.device("cpu"), in_store, fp32=True, step=True)
    assert r["grad_dtype"] == torch.float32 and r["chunk_grads"] == {torch.float32}
    if in_store:
        assert r["slots"] == {torch.float32} and not r["main_grads"]
    else:
        assert r["main_grads"] and r["main"] == {torch.float32} and not r["p_grad"]  # bf16 grads released
    assert _rel(r["seen"], r["ref32"]) == 0.0  # the optimizer's backward passes saw the same micro batches
    assert _rel(r["zc"], r["ref32"]) <= 1e-6
    assert _rel(r["ref16"], r["ref32"]) > 1e-4  # which a bf16 sum misses
    ok, norm, _ = r["step"]
    expected = torch.sqrt(sum((g.double() ** 2).sum() for g in r["ref32"].values())).item()
    assert ok and norm == pytest.approx(expected, rel=1e-6)

    o = r["cfg"].optim  # torch's AdamW on fp32 copies of the bf16 weights, from the fp32 sum
    masters = {k: torch.nn.Parameter(v.clone()) for k, v in r["initial"].items()}
    for k, p in masters.items():
        p.grad = r["ref32"][k].clone()
    torch.nn.utils.clip_grad_norm_(list(masters.values()), o.clip_grad)
    groups = [{"params": [p for k, p in masters.items() if no_weight_decay(k, p) == skip],
               "weight_decay": 0.0 if skip else o.weight_decay} for skip in (False, True)]
    torch.optim.AdamW(groups, lr=r["opt"].param_groups[0]["lr"], betas=(o.adam_beta1, o.adam_beta2),
                      eps=o.adam_eps).step()
    names = {id(p): k for k, p in r["model"].named_parameters()}
    layout, bufs = r["opt"].layout, r["opt"].buffers.chunks
    new = {names[id(p)]: view.clone() for c in layout.chunks for p, view in c.views(bufs[c.index].states[0])}
    assert _rel(new, {k: p.detach() for k, p in masters.items()}) < 1e-6
    offloaded = [bufs[c.index] for c in layout.chunks if layout.partitioned[c.group]]
    assert offloaded and all(b.weights.dtype == torch.bfloat16 and b.weights.data_ptr() != b.grad.data_ptr()
                             for b in offloaded)
    with r["opt"].materialized():
        for c in layout.chunks:
            for p, view in c.views(bufs[c.index].states[0]):
                assert torch.equal(p.detach().cpu(), view.to(torch.bfloat16)), names[id(p)]
    r["opt"].close()


@pytest.mark.parametrize("in_store", one_quick(False, [True, False]), ids=["in-store", "on-device"])
def test_the_opt_out_adds_up_in_the_model_dtype(megatron_single_rank, in_store):
    """optim.accumulate_grads_in_fp32=false: buffers, slots and autograd's running sums in bf16, and the
    flushed gradients are the bf16 sum (off the fp32 one by bf16 rounding)."""
    r = accumulate(torch.device("cpu"), in_store, fp32=False)
    assert r["grad_dtype"] == torch.bfloat16 and r["chunk_grads"] == {torch.bfloat16}
    assert not r["main_grads"] and not r["main"]
    if in_store:
        assert r["slots"] == {torch.bfloat16}
    else:
        assert r["p_grad"] == {torch.bfloat16}  # autograd adds up in p.grad
    assert _rel(r["zc"], r["ref16"]) == 0.0
    assert _rel(r["zc"], r["ref32"]) > 1e-4
    r["opt"].close()


def test_one_micro_batch_keeps_gradients_in_the_model_dtype(megatron_single_rank):
    """With one micro batch nothing adds up: no fp32 buffers are spent, the gradient is the micro batch's."""
    r = accumulate(torch.device("cpu"), in_store=False, fp32=True, micro=1)
    assert r["grad_dtype"] == torch.bfloat16 and r["chunk_grads"] == {torch.bfloat16} and not r["main_grads"]
    assert _rel(r["zc"], r["ref16"]) == 0.0
    r["opt"].close()


@pytest.mark.slow  # the tiny model stepped with each CPU AdamW
@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")
def test_the_native_and_torch_cpu_adamw_agree_on_fp32_gradients(megatron_single_rank):
    """The one-pass kernel reads the fp32 sums (and writes bf16 weights) as torch's path does."""
    masters = []
    for kernel in ("native", "torch"):
        r = accumulate(torch.device("cpu"), True, fp32=True, step=True, extra=[f"zero_cache.cpu_adam={kernel}"])
        assert (r["opt"].cpu_adam is not None) == (kernel == "native")
        masters.append(torch.cat([b.states[0].clone() for b in r["opt"].buffers.chunks]))
        r["opt"].close()
    torch.testing.assert_close(masters[0], masters[1], rtol=1e-5, atol=1e-7)
