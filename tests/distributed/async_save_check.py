"""torchrun worker for the asynchronous checkpoint test (CPU, gloo).

    torchrun --standalone --nproc-per-node 2 tests/distributed/async_save_check.py ASYNC_DIR REF_DIR

Trains the tiny GPT with ZeRO-Cache for 4 iterations, saving every 2 into ASYNC_DIR with
checkpoint.async_save: the save of iteration 2 is written by the background thread, which is held until
iteration 3's optimizer step has updated the states in place, so it writes after training has moved
on. At iteration 2 the same state is also saved synchronously into REF_DIR.
"""

import sys
import threading
import warnings

warnings.filterwarnings("ignore")


def main() -> None:
    from angelgpt.config import parse
    from angelgpt.planner import MACHINES, resolve_config
    from angelgpt.train import checkpoint, checkpoint_writer
    from angelgpt.train.worker import make_trainer

    async_dir, ref_dir = sys.argv[1], sys.argv[2]
    cfg = parse("tiny", None, ["train.device=cpu", "optim.optimizer=zero_cache", "train.train_iters=4",
                                 "checkpoint.save_interval=2", f"checkpoint.save={async_dir}",
                                 "checkpoint.async_save=true", "logging.log_interval=1"])
    cfg, _ = resolve_config(cfg, MACHINES["h200"], 2, 1, on_gpu=False)  # on the CPU: the machine's figures unused
    trainer = make_trainer(cfg)
    stepped = threading.Event()

    def held_start(job, group):  # WriteJob.start, its thread first waiting for the next optimizer step
        def run():
            if not stepped.wait(120):
                raise RuntimeError("no optimizer step after the save")
            job.write(group)

        job.thread = threading.Thread(target=run, daemon=True)
        job.thread.start()

    checkpoint_writer.WriteJob.start = held_start
    step, save = trainer.optimizer.step, trainer.save

    def step_then_release():
        out = step()
        if trainer.iteration == 2:  # iteration 3's step, its updates applied
            trainer.optimizer.wait()
            stepped.set()
        return out

    def save_with_reference(last):
        if trainer.iteration == 2:
            ref = checkpoint.Saver(ref_dir, {}, None, True, trainer.device)
            ref.save(trainer.iteration, trainer.consumed, trainer.model, trainer.optimizer, trainer.scheduler,
                     asynchronous=False)
        save(last)
        if trainer.iteration == 2:
            assert trainer.saver.pending is not None and not trainer.saver.pending[2].done()

    trainer.optimizer.step, trainer.save = step_then_release, save_with_reference
    trainer.train()
    from angelgpt import parallel

    parallel.destroy()


if __name__ == "__main__":
    main()
