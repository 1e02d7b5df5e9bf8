"""Training throughput benchmark: runs `angelgpt train` and writes one result file.

    python scripts/bench_train.py --name h200-5b-megatron --size h200-5b --iters 12 --warmup 4 \\
        --goal-tflops 540 -- optim.optimizer=megatron
    python scripts/bench_train.py --runner deepspeed --name ds-L7 --size h200-16b -- model.num_layers=7

A command-line wrapper: the code is benchmarks/train.py (`python -m benchmarks.train` is the same).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the benchmarks package of this checkout

from benchmarks.train import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
