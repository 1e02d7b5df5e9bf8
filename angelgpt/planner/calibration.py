"""The planner's calibration: every constant of the memory and time model that was measured, fitted to a
run or assumed, each beside the committed result files (or measurements) that set it; and GIB.

The machines' own figures and their sources are planner.machines's. Each fitted constant here names the
committed result files (benchmarks/results/) that set it: the planner's calibration set, which
tests/data/planner_runs.json keeps apart from the runs that validate it.
"""

from angelgpt.system import GIB  # noqa: F401 (one definition; the planner takes it from here)

MODEL_BYTES = 2  # bf16 weights and gradients on GPU
# assumed: a round allowance for cuBLAS workspace, NCCL buffers and allocator slack, never fitted to a run
WORKSPACE = 3 * GIB  # cuBLAS workspace, NCCL buffers, allocator slack
# assumed: what a CUDA context takes on the H200, never recorded in a committed result file
CUDA_CONTEXT = 1 * GIB  # taken before anything is allocated (not in torch.cuda.mem_get_info's free)
# the Python process with torch, CUDA and Megatron loaded: 1.7-1.8 GiB measured as the peak host memory of
# runs that keep nothing on the host (peers-megatron-L7-mb4-gb32.json, peers-zero_cache-L7-mb4-gb32.json)
HOST_PROCESS = int(1.8 * GIB)
# each direction's share of the pinned rate when host-to-device and device-to-host copies run at once
# (measured: ../shared/FACTS.md, the H200 machine: 97.1 GB/s both directions together against 55.3 alone;
# assumed the same elsewhere)
PCIE_DUPLEX_SHARE = 97.1 / (2 * 55.3)

# Accumulating in the store (zero_cache.accumulate_in_store), the share of a micro batch's backward that
# the host sums' round trips hide behind: a sub-group's trip starts only once backward has produced its
# gradients, and a slot is waited for before the next one is filled. Fitted to 16 layers of the 55 shape
# with fp32 sums, 16 micro batches, trips (0.64 s) longer than the backward (0.56 s): measured 16.78 s a
# step (peers-zero_cache-L16-mb2-gb32-recomputeauto.json). With bf16 sums the trips hide whole (19 layers,
# 16 micro batches: peers-zero_cache-L19-mb2-gb32.json, the step 2.6 s over compute, 2.0 s of it the update).
IN_STORE_TRIP_HIDDEN = 0.72

# ZeRO-Cache's host update with device_update_fraction, measured on the H200 in training (11 and 19 layers
# of the 55 shape, 1.9B and 8.9B host-resident parameters, 45% and 56% of them updated on the GPU, the
# one-pass CPU AdamW): the device path ran 2.2-2.7 G params/s (26 bytes a parameter over PCIe, both
# ways), the CPU beside it 3.0-3.8 (median 3.5), 1.52x the machine's cpu_update_gparams (on the H200 the
# CPU alone in training, 2.3, where it writes offloaded layers' weights; beside device updates its chunks
# are of resident-weight layers); other machines scale with their PCIe and CPU figures. At 19 layers, one
# machine: 0.45 on the GPU made 421.0 model TFLOP/s against 414.3 at 0.56, the device path still the
# longer of the two (1.69 against 1.34 s). Runs: peers-zero_cache-L11-mb1-gb32-recomputenone-devupdate0.45.json,
# peers-zero_cache-L19-mb2-gb32-recomputeauto-devupdate0.45.json,
# peers-zero_cache-L19-mb2-gb32-recomputeauto-split0.56.json
DEVICE_UPDATE_PER_PCIE_GBS = 2.55 / 55.0
# the bytes a parameter those runs moved over PCIe in the device update (bf16 gradient up; fp32 master and
# moments up and back down): another format's device path runs at the rate scaled by its own bytes (the
# path is PCIe-bound: 66 GB/s of the 97.1 both directions carry together)
DEVICE_UPDATE_BYTES = 2 + 2 * 12
CPU_BESIDE_DEVICE_UPDATE = 1.52
# zero_cache.cpu_adam torch (fp32 gradient scratch, torch's fused AdamW, weights converted back) against
# the one-pass kernel, same benchmark: 2.09 against 2.81 G params/s (cpu_adam-67108864-static-split.json)
TORCH_CPU_UPDATE = 0.74
# fp8 moments (optim.exp_avg_dtype / exp_avg_sq_dtype fp8) on the host, against the fp32 one-pass kernel
# in the same run (2 CPUs, 2**26 elements, both moments fp8, remainders): the kernel's block path 0.68
# against 1.44 G params/s, 0.47; torch's codec around fused AdamW (cpu_adam torch) 0.022, 0.015
# (cpu_adam-67108864.json). Compute-bound there; not yet measured on the H200's host.
FP8_CPU_UPDATE = 0.47
TORCH_FP8_CPU_UPDATE = 0.015

# Accumulating in the store, the GPU memory that gradients on their way to the host hold after autograd
# has let them go (the H2D stream still reads them), which the caching allocator cannot hand out again
# meanwhile, beyond what the plan's workspace and in-flight gradients already cover. Measured on the H200
# (55 shape): at 11 layers, 32 micro batches, memory reserved peaked at 131.9 GiB against 132.5 planned
# (rate 0.79, no allocator retries); at 19 layers, 16 micro batches, 137.3 against 135.3 (rate 0.42, 0-1
# retries a step). Counted in layers' gradients: two (peers-zero_cache-L11-mb1-gb32-recomputenone-rate0.79.json,
# peers-zero_cache-L19-mb2-gb32-recomputeauto.json). (While every released gradient was also marked with the
# D2H stream, reserved ran 18.3 GiB over allocated at 11 layers and this was six:
# peers-zero_cache-L11-mb1-gb32-recomputenone-rate0.74.json.)
STREAM_HELD_LAYERS = 2

# torch's fused AdamW on the H200, 120 G params/s (FACTS.md's probe; no committed result file): Megatron's
# optimizers' GPU update
GPU_ADAMW_PARAMS_PER_S = 120e9
# without transformer-engine or apex Megatron steps with torch's foreach AdamW, whose temporaries
# came to 4 bytes per parameter on the H200: 7 layers of the 55 shape peaked at 124.4 GiB allocated
# with micro batch 1, 2 and 4 alike (weights, main grads, states and these: 124.3;
# peers-megatron-L7-mb1-gb32-recomputenone.json, peers-megatron-L7-mb2-gb32-recomputenone.json,
# peers-megatron-L7-mb4-gb32.json)
MEGATRON_STEP_TEMPORARY_BYTES = 4
# Megatron's HybridDeviceOptimizer (megatron_cpu_offload), per parameter of the rank's shard offloaded:
# transfer buffers on the GPU, measured 2.8 B/param on the H200 (7 layers of the 55 shape, fraction 1.0:
# 61.3 GiB). Host: 16.9 B/param measured between steps (7 layers, fraction 1.0: 97.2 GiB; both from
# peers-megatron_cpu_offload-L7-mb4-gb32.json) and a transient fp32 gradient copy during the step
# (4 B/param), which the host OOM kills at 8 layers (fraction 1.0) and 12 and 13 layers (fraction 0.7)
# show (megatron_cpu_offload-L8-fraction1.0-host-oom.json, megatron_cpu_offload-L12-fraction0.7-host-oom.json,
# peers-megatron_cpu_offload-L13-mb2-gb32.json)
HYBRID_TRANSFER_BUFFER_BYTES = 2.8
HYBRID_HOST_STATE_BYTES = 16.9
HYBRID_STEP_TRANSIENT_BYTES = 4
