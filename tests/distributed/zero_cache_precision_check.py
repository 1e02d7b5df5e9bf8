"""torchrun worker for ZeRO-Cache's compact states at DP 2 (CPU, gloo, the tiny model in bf16).

    torchrun --standalone --nproc-per-node 2 tests/distributed/zero_cache_precision_check.py OUT_DIR

Per layout of tests/unit/test_zero_cache_precision.py: the fp32 path and the compact one (the master as a
remainder beside the bf16 weight, bf16 moments) from the same model, each rank its own batches; after a
step, whether each rank's owned masters are equal bit for bit, its moments the fp32 path's rounded and
its weights the masters split; the losses of three more steps. Then a checkpoint of the compact
optimizer loaded into a fresh fp32 one: whether the masters came back bit for bit; and one of fp8 moments
loaded into a fresh fp8 optimizer: whether the next step's states and loss are the saving one's. Writes
OUT_DIR/rank<r>.json.
"""

import json
import sys
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def main(out: Path) -> None:
    from angelgpt import parallel
    from angelgpt.zero_cache.precision import split_master
    from tests.unit.test_zero_cache_precision import (FORMATS, FP8, LAYOUTS, _load, _save, build, states, tiers,
                                                      train_step)

    parallel.initialize(1, 1, on_gpu=False)
    rank = dist.get_rank()
    work = out / "work"
    dp2 = ["train.global_batch_size=8"]  # two micro batches of 2 on each of the two ranks
    result = {"rank": rank, "layouts": {}}
    for layout in LAYOUTS:
        cfg, model, opt = build(work, dp2, name=f"ref-{layout}", layout=layout)
        cfg2, model2, opt2 = build(work, [*FORMATS["both"], *dp2], name=f"compact-{layout}", layout=layout,
                                   host=0.004)
        first = (train_step(cfg, model, opt, 1 + 100 * rank), train_step(cfg2, model2, opt2, 1 + 100 * rank))
        ref, got = states(model, opt), states(model2, opt2)
        masters = moments = weights = True
        for k in ref:
            master, m, v, _ = ref[k]
            master2, m2, v2, w2 = got[k]
            masters &= torch.equal(master2.view(torch.int32), master.view(torch.int32))
            moments &= torch.equal(m2, m.to(m2.dtype)) and torch.equal(v2, v.to(v2.dtype))
            hi, rem = torch.empty_like(w2), torch.empty(master.shape, dtype=torch.int16)
            split_master(master, hi, rem)
            weights &= torch.equal(w2, hi)
        later = [(train_step(cfg, model, opt, s + 100 * rank), train_step(cfg2, model2, opt2, s + 100 * rank))
                 for s in (2, 3, 4)]
        result["layouts"][layout] = {"tiers": sorted(tiers(opt2)), "owned": len(ref), "first": first,
                                     "masters_equal": masters, "moments_rounded": moments,
                                     "weights_split": weights, "losses": later}
        if layout == "offloaded":  # a checkpoint of the compact optimizer into a fresh fp32 one
            _save(model2, opt2, work / "ck")
            cfg3, model3, opt3 = build(work, dp2, name="loaded", layout=layout)
            _load(model3, opt3, work / "ck")
            saved, loaded = states(model2, opt2), states(model3, opt3)
            result["checkpoint_masters_equal"] = all(
                torch.equal(loaded[k][0].view(torch.int32), saved[k][0].view(torch.int32)) for k in saved)
            opt3.close()
            # fp8 moments at DP 2: saved after a step, loaded into a fresh optimizer, the next step's
            # states (masters, decoded moments, weights, scales) and loss the saving optimizer's own
            fp8 = [*FP8["smallest"], *dp2]
            cfg4, model4, opt4 = build(work, fp8, name="fp8-saved", layout=layout, host=0.004)
            cfg5, model5, opt5 = build(work, fp8, name="fp8-loaded", layout=layout, host=0.004)
            train_step(cfg4, model4, opt4, 5 + 100 * rank)
            _save(model4, opt4, work / "ck-fp8")
            _load(model5, opt5, work / "ck-fp8")
            losses = (train_step(cfg4, model4, opt4, 6 + 100 * rank), train_step(cfg5, model5, opt5, 6 + 100 * rank))
            a, b = states(model4, opt4), states(model5, opt5)
            result["fp8_resume_equal"] = losses[0] == losses[1] and all(
                torch.equal(x, y) for k in a for x, y in zip(a[k], b[k]))
            opt4.close()
            opt5.close()
        opt.close()
        opt2.close()
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
