"""Peer (c) of the side-by-side benchmark: the same GPT, data and optimizer settings trained by DeepSpeed
ZeRO with CPU offload (`pip install 'angelgpt[bench]'`).

    python scripts/bench_deepspeed.py --size h200-16b --metrics-file /tmp/m.jsonl train.train_iters=6 \\
        model.num_layers=7 train.micro_batch_size=8 train.global_batch_size=32 deepspeed_config=zero2_offload_opt

A command-line wrapper: the code is benchmarks/deepspeed_peer.py (`python -m benchmarks.deepspeed_peer`
is the same).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the benchmarks package of this checkout

from benchmarks.deepspeed_peer import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
