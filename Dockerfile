# angelgpt on an NVIDIA PyTorch container (CUDA, NCCL and transformer-engine included).
#   docker build -t angelgpt .
#   docker run --gpus all --ipc=host --net=host --ulimit memlock=-1 --ulimit stack=67108864 \
#     -v /data:/data angelgpt angelgpt train --size 55
FROM nvcr.io/nvidia/pytorch:25.10-py3

# no CUDA_DEVICE_MAX_CONNECTIONS here: the launcher sets 1 for Megatron's optimizers, and ZeRO-Cache
# needs several hardware queues
ENV PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \
    PYTHONUNBUFFERED=1

WORKDIR /opt/angelgpt
COPY pyproject.toml README.md ./
COPY angelgpt ./angelgpt
COPY configs ./configs
COPY scripts ./scripts
COPY tests ./tests
# torch and transformer-engine come with the base image; keep them.
RUN pip install --no-cache-dir -e ".[test]" && angelgpt presets list

CMD ["angelgpt", "--help"]
