"""A training worker whose ranks all share GPU 0 under a gloo default group (tests/shared_device.py's
SharedDevice, an angelgpt.parallel.DeviceSharing): several ranks where one GPU is lent. Started by
torchrun on a resolved run config, as tests/helpers.py's `train_shared_gpu` does:

    torchrun --standalone --nproc-per-node 2 tests/gpu/shared_gpu_worker.py --run-config RUN_DIR/run-config.yaml
"""

import sys

from angelgpt.train import worker
from tests.shared_device import SharedDevice

if __name__ == "__main__":
    sys.exit(worker.main(sharing=SharedDevice()))
