"""The planner's calibration: every constant of the memory and time model that is measured, fitted to a
run or assumed, and GIB.

The numbers live in calibration.json beside this module (packaged with it), each with what it is and its
source: the committed result files under benchmarks/results/ it comes from, or why there is none. Those
runs are the planner's calibration set, which tests/data/planner_runs.json keeps apart from the runs
that validate the planner. The machines' own figures and their sources are planner.machines's.
"""

import json
from pathlib import Path

from angelgpt.system import GIB  # noqa: F401 (one definition; the planner takes it from here)

_DATA = json.loads(Path(__file__).with_name("calibration.json").read_text())

# bytes of a bf16 weight and of its gradient on the GPU
MODEL_BYTES = 2
WORKSPACE = _DATA["WORKSPACE"]["gib"] * GIB
CUDA_CONTEXT = _DATA["CUDA_CONTEXT"]["gib"] * GIB
HOST_PROCESS = int(_DATA["HOST_PROCESS"]["gib"] * GIB)
PCIE_DUPLEX_SHARE = (_DATA["PCIE_DUPLEX_SHARE"]["both_directions_gbs"]
                     / (2 * _DATA["PCIE_DUPLEX_SHARE"]["one_direction_gbs"]))
IN_STORE_TRIP_HIDDEN = _DATA["IN_STORE_TRIP_HIDDEN"]["value"]
DEVICE_UPDATE_PER_PCIE_GBS = (_DATA["DEVICE_UPDATE_PER_PCIE_GBS"]["device_path_gparams"]
                              / _DATA["DEVICE_UPDATE_PER_PCIE_GBS"]["pcie_gbs"])
# bytes a parameter the device update moves over PCIe in the fp32 format DEVICE_UPDATE_PER_PCIE_GBS was
# measured with: a bf16 gradient up, fp32 master and two moments up and back down. The path is PCIe-bound,
# so another format's device update runs at that rate scaled by these bytes over its own.
DEVICE_UPDATE_BYTES = 2 + 2 * 12
CPU_BESIDE_DEVICE_UPDATE = _DATA["CPU_BESIDE_DEVICE_UPDATE"]["value"]
TORCH_CPU_UPDATE = _DATA["TORCH_CPU_UPDATE"]["value"]
FP8_CPU_UPDATE = _DATA["FP8_CPU_UPDATE"]["value"]
TORCH_FP8_CPU_UPDATE = _DATA["TORCH_FP8_CPU_UPDATE"]["value"]
STREAM_HELD_LAYERS = _DATA["STREAM_HELD_LAYERS"]["value"]
GPU_ADAMW_PARAMS_PER_S = _DATA["GPU_ADAMW_PARAMS_PER_S"]["value"]
MEGATRON_STEP_TEMPORARY_BYTES = _DATA["MEGATRON_STEP_TEMPORARY_BYTES"]["value"]
HYBRID_TRANSFER_BUFFER_BYTES = _DATA["HYBRID_TRANSFER_BUFFER_BYTES"]["value"]
HYBRID_HOST_STATE_BYTES = _DATA["HYBRID_HOST_STATE_BYTES"]["value"]
HYBRID_STEP_TRANSIENT_BYTES = _DATA["HYBRID_STEP_TRANSIENT_BYTES"]["value"]
