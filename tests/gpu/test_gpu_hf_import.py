"""`angelgpt import` then `angelgpt train --load` on a GPU with every optimizer (ZeRO-Cache also with
every state and layer weight on the host): the optimizer's main parameters are the imported weights (a step moves them a little; a fresh model's
main parameters would replace them and the loss would fall to a fresh model's at once). Skipped
without CUDA."""

import math

import pytest
import torch

from tests.helpers import read_metrics, run_cli, run_cli_in_process

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

VOCAB = 512


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("hf")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(100)  # confident and wrong: its loss (tens) is no fresh model's (ln vocab)
    model.save_pretrained(root / "hf")
    proc = run_cli_in_process("import", "--hf", root / "hf", "--save", root / "ck")
    assert proc.returncode == 0, proc.stderr
    return root / "ck"


@pytest.mark.parametrize("optimizer", ["megatron", "megatron_cpu_offload", "zero_cache", "zero_cache:host"])
def test_gpu_training_starts_from_the_imported_weights(imported, optimizer, tmp_path):
    optimizer, _, where = optimizer.partition(":")
    placement = ["zero_cache.prefetch_cache_sub_group_rate=0", "zero_cache.offload_params=true"] if where else []
    metrics = tmp_path / "m.jsonl"
    proc = run_cli("train", "--config", imported / "config.yaml", "--load", imported, "--device", "cuda",
                   "--metrics-file", metrics, "logging.log_interval=1", "train.train_iters=4",
                   "train.micro_batch_size=2", "train.global_batch_size=4", "model.seq_length=64",
                   f"optim.optimizer={optimizer}", *placement)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    losses = [r["lm_loss"] for r in read_metrics(metrics) if "lm_loss" in r]
    assert len(losses) == 4 and all(loss > 2 * math.log(VOCAB) for loss in losses), losses
