"""Side-by-side benchmark of ZeRO-Cache and its peers on one machine, and BENCHMARKS.md from its results.

    python scripts/bench_peers.py run megatron:9 zero_cache:20 zero_cache_nvme:23 --iters 3 --warmup 1
    python scripts/bench_peers.py report     # BENCHMARKS.md (benchmarks/BENCHMARKS.md.template), peers.png

A command-line wrapper: the code is benchmarks/peers.py and benchmarks/report.py
(`python -m benchmarks.peers` is the same).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the benchmarks package of this checkout

from benchmarks.peers import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
