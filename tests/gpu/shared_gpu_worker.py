"""A training worker whose ranks all share GPU 0 under a gloo default group (parallel.SharedDevice):
several ranks where one GPU is lent. Started by torchrun, as tests/gpu/conftest.py's `shared_gpu` does:

    torchrun --standalone --nproc-per-node 2 tests/gpu/shared_gpu_worker.py --size tiny ...
"""

import sys

from angelgpt.parallel import SharedDevice
from angelgpt.train import worker

if __name__ == "__main__":
    sys.exit(worker.main(shared=SharedDevice()))
