"""Run under torchrun with PP > 1 and tied embeddings: trains through angelgpt's worker and, at the end
(before the optimizer closes, every update applied), compares this rank's copy of the tied word
embeddings (the first stage's embedding, the last stage's output weight) with the other stage's.

    torchrun --nproc-per-node 2 tests/distributed/pipeline_tied_check.py OUT_DIR --run-config RUN_CONFIG

Writes OUT_DIR/rank<R>.json: stage, whether the two copies are bitwise equal, their largest difference,
and how far this copy moved from its initial value. ANGELGPT_CHECK_NO_EMBEDDING_SYNC=1 leaves the
gradient all-reduce out (the copies must then drift apart: the check can see it).
"""

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist


def main():
    out, argv = Path(sys.argv[1]), sys.argv[2:]
    import angelgpt.optimizer.cpu as optim
    import angelgpt.train.worker as worker
    import angelgpt.zero_cache.gradients as zc_gradients
    from angelgpt.parallel.embedding import tied_embedding_weight

    if os.environ.get("ANGELGPT_CHECK_NO_EMBEDDING_SYNC") == "1":
        optim.sync_tied_embedding_grads = lambda model: None
        zc_gradients.allreduce_tied_embedding_grad = lambda grad: None
    build = worker.build

    def build_and_watch(cfg, on_gpu, beside_store_bytes=0, **kwargs):
        model, optimizer, scheduler = build(cfg, on_gpu, beside_store_bytes, **kwargs)
        weight = tied_embedding_weight(model)
        initial = weight.detach().clone() if weight is not None else None
        close = optimizer.close

        def check_then_close():
            from megatron.core import parallel_state

            optimizer.wait()
            with optimizer.materialized():
                record = {"rank": dist.get_rank(), "stage": parallel_state.get_pipeline_model_parallel_rank()}
                if weight is not None:
                    group = parallel_state.get_embedding_group()
                    copies = [torch.empty_like(weight) for _ in range(group.size())]
                    dist.all_gather(copies, weight.detach().contiguous(), group=group)
                    record.update(equal=all(torch.equal(copies[0], c) for c in copies),
                                  max_diff=max(float((copies[0] - c).abs().max()) for c in copies),
                                  moved=float((weight.detach() - initial).abs().max()))
            out.mkdir(parents=True, exist_ok=True)
            (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(record))
            close()

        optimizer.close = check_then_close
        return model, optimizer, scheduler

    worker.build = build_and_watch
    sys.exit(worker.main(argv))


if __name__ == "__main__":
    main()
